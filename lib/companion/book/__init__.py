"""The book's machinery: chapters executed with papermill, their records, and the pages.

Nothing in the science packages (``hasse``, ``context_similarity``, ``gradient_flow``,
``sbm``, ``lra``) imports this package (tests/test_import_rules.py).

What a chapter uses:

- ``chapter``: :func:`begin_chapter` (parameters, seeding, figure style, the active
  chapter); ``records``: figures, tables and claims saved with their provenance;
  ``claims``: how a claim is judged (acceptance regions, verdicts); ``prose``: the words
  of a chapter's summary sentences, computed from its numbers

What builds the book:

- ``runner``, ``cli``: execute a chapter (one run path for the book and ``--out``) and
  build the book, with ``parameters`` (the parameters cell, coercion, scales),
  ``cache`` (the cache key, the chapter's lock), ``notebook_cells`` (what the runner
  adds to a notebook), ``kernel`` (execution, progress, limits) and ``build`` (the
  parallel build, its summary, the HTML); ``project``: the project's
  places and the records both the runner and the pages read; ``pages`` (figure index,
  reproduction report); ``myst``: every MyST string the book writes; ``citations``
  (BibTeX, the Cite line); ``htmlcheck`` (browser check), ``htmlcheck_cache`` (the
  passes it need not repeat: pages unchanged since a passing check); ``interrupts`` (Ctrl-C as a
  recorded state); ``files`` (atomic writes), ``gitstate`` (repository, commit)
- ``claims_diff``: the claims that differ between two builds; ``site``: the book's
  addresses
"""

# What a chapter calls: open the chapter, then save figures, tables and claims with their
# provenance (``from companion.book import begin_chapter, claim, save_figure, save_table``).
from companion.book.chapter import ENV_THREADS, begin_chapter
from companion.book.gitstate import repo_root
from companion.book.records import claim, record_inventory, save_figure, save_table

__all__ = ["ENV_THREADS", "begin_chapter", "claim", "record_inventory", "repo_root",
           "save_figure", "save_table"]
