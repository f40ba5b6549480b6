"""The book's machinery: chapters executed with papermill, their records, and the pages.

Nothing in the science packages (``hasse``, ``context_similarity``, ``gradient_flow``,
``sbm``, ``lra``) imports this package (tests/test_import_rules.py).

- ``provenance``: figures, tables and claims saved with their provenance
- ``prose``: the words of a chapter's summary sentences, computed from its numbers
- ``runner``, ``cli``: execute chapters and build the book; ``pages`` (figure index,
  reproduction report); ``htmlcheck`` (browser check); ``interrupts`` (Ctrl-C as a
  recorded state)
- ``claims_diff``: the claims that differ between two builds; ``site``: the book's
  addresses
"""

# What a chapter calls: open the chapter, then save figures, tables and claims with their
# provenance (``from companion.book import begin_chapter, claim, save_figure, save_table``).
from companion.book.provenance import (  # noqa: E402
    ENV_THREADS, begin_chapter, claim, repo_root, save_figure, save_table,
)

__all__ = ["ENV_THREADS", "begin_chapter", "claim", "repo_root", "save_figure", "save_table"]
