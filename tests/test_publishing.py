"""Publishing: the Pages workflow, the book's addresses (one source, every copy equal),
the distribution's name, the conda/Binder environments, CITATION.cff and the PDF set-up.

All static or on temporary copies: nothing is built or downloaded.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from companion.book import site
from conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "book.yml"
ADDRESS_FILES = ("_config.yml", "CITATION.cff", "pyproject.toml")


def _config() -> dict:
    return yaml.safe_load((REPO / "_config.yml").read_text())


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# --------------------------------------------------------------------------- workflow


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(job: dict) -> list[dict]:
    return job["steps"]


def _index(steps: list[dict], predicate) -> int:
    found = [i for i, s in enumerate(steps) if predicate(s)]
    assert found, "expected step missing"
    return found[0]


def test_workflow_builds_on_push_to_main_and_by_hand():
    flow = _workflow()
    triggers = flow.get("on", flow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert triggers["push"]["branches"] == ["main"]
    assert "workflow_dispatch" in triggers


def test_workflow_builds_publishes_and_uploads_logs_on_failure():
    jobs = _workflow()["jobs"]
    build = _steps(jobs["build"])
    runs = [s.get("run", "") for s in build]
    uses = [s.get("uses", "") for s in build]
    assert any(u.startswith("actions/checkout@") for u in uses)
    setup = build[_index(build, lambda s: s.get("uses", "").startswith("actions/setup-python@"))]
    assert str(setup["with"]["python-version"]) == "3.11"
    # torch's CPU wheel, not PyPI's CUDA build
    assert "download.pytorch.org/whl/cpu" in jobs["build"]["env"]["PIP_EXTRA_INDEX_URL"]

    i_build = _index(build, lambda s: re.search(r"^\s*make publish\s*$", s.get("run", ""), re.M))
    i_pdf = _index(build, lambda s: re.search(r"^\s*make pdf\s*$", s.get("run", ""), re.M))
    i_nojekyll = _index(build, lambda s: "touch book/_build/html/.nojekyll" in s.get("run", ""))
    i_upload = _index(build, lambda s: s.get("uses", "").startswith(
        "actions/upload-pages-artifact@"))
    assert build[i_upload]["with"]["path"] == "book/_build/html"
    assert i_build < i_pdf < i_nojekyll < i_upload, "build, PDF, .nojekyll, then upload"
    assert not any("if" in build[i] for i in (i_build, i_pdf, i_nojekyll, i_upload))

    failure = build[_index(build, lambda s: s.get("uses", "").startswith(
        "actions/upload-artifact@"))]
    assert failure["if"] == "failure()"
    assert failure["with"]["path"].rstrip("/") == "book/_generated/logs"
    assert len(runs) == len(build)

    deploy = jobs["deploy"]
    assert deploy["needs"] == "build"
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert deploy["environment"]["name"] == "github-pages"
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in deploy["steps"])


def test_workflow_pushes_the_branch_the_launch_buttons_open():
    build = _workflow()["jobs"]["build"]
    assert build["permissions"]["contents"] == "write"
    push = "\n".join(s.get("run", "") for s in build["steps"])
    assert f"HEAD:refs/heads/{site.launch_branch(REPO)}" in push
    assert "git add -f book/_generated/chapters/*.ipynb" in push


# --------------------------------------------------------------------------- addresses


def test_every_copy_of_the_addresses_agrees_with_site():
    repository = site.repository_url(REPO)
    copies = site.address_copies(REPO)
    assert None not in copies.values(), copies
    assert copies == site.expected_copies(repository)
    assert site.pages_url(REPO) + "/" == site.pages_url_for(repository)
    assert site.repository_branch(REPO) == "main"


def test_config_turns_on_repository_issue_and_launch_buttons():
    config = _config()
    assert config["html"]["use_repository_button"] is True
    assert config["html"]["use_issues_button"] is True
    launch = config["launch_buttons"]
    assert launch["binderhub_url"] == "https://mybinder.org"
    assert launch["colab_url"] == "https://colab.research.google.com"
    assert config["repository"]["path_to_book"] == ""  # _config.yml sits at the root
    assert (REPO / config["repository"]["path_to_book"] / "_config.yml").exists()
    # the theme option that moves the launch buttons to the notebooks branch is merged
    # into Jupyter Book's, not a replacement of all its theme options
    assert config["sphinx"]["recursive_update"] is True
    assert site.launch_branch(REPO) == site.LAUNCH_BRANCH


def _copy_address_files(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ADDRESS_FILES:
        shutil.copy(REPO / name, folder / name)
    return folder


def test_set_url_rewrites_every_copy_and_nothing_else(tmp_path):
    root = _copy_address_files(tmp_path / "fork")
    before = {name: (root / name).read_text().splitlines() for name in ADDRESS_FILES}
    expected = site.set_url(root, "https://github.com/Octo-Cat/my.book.git/")
    assert expected["_config.yml repository.url"] == "https://github.com/Octo-Cat/my.book"
    assert expected["_config.yml html.baseurl"] == "https://octo-cat.github.io/my.book/"
    assert site.address_copies(root) == expected
    assert site.repository_url(root) == "https://github.com/Octo-Cat/my.book"
    assert site.pages_url(root) == "https://octo-cat.github.io/my.book"
    # every other line (comments, pins, keys) is as it was; the files still parse
    changed = {"_config.yml": 2, "CITATION.cff": 2, "pyproject.toml": 3}
    for name in ADDRESS_FILES:
        after = (root / name).read_text().splitlines()
        assert len(after) == len(before[name])
        diff = [(a, b) for a, b in zip(before[name], after) if a != b]
        assert len(diff) == changed[name], diff
        assert all("Octo-Cat" in b or "octo-cat" in b for _, b in diff)
    assert yaml.safe_load((root / "_config.yml").read_text())["repository"]["branch"] == "main"
    assert yaml.safe_load((root / "CITATION.cff").read_text())["title"] == "Attention, Reproduced"
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"] == (
        site.DISTRIBUTION)
    # idempotent, and back to the original address gives the original files
    site.set_url(root, "https://github.com/Octo-Cat/my.book")
    assert site.address_copies(root) == expected
    site.set_url(root, site.repository_url(REPO))
    for name in ADDRESS_FILES:
        assert (root / name).read_text().splitlines() == before[name]


@pytest.mark.parametrize("url", [
    "http://github.com/o/r", "https://gitlab.com/o/r", "https://github.com/o",
    "https://github.com/o/r/tree/main", "github.com/o/r", "", "https://github.com/-o/r",
])
def test_set_url_refuses_what_is_not_a_github_repository(tmp_path, url):
    root = _copy_address_files(tmp_path / "fork")
    before = {name: (root / name).read_text() for name in ADDRESS_FILES}
    with pytest.raises(ValueError, match=r"^url: expected a GitHub repository address"):
        site.set_url(root, url)
    assert {name: (root / name).read_text() for name in ADDRESS_FILES} == before


def test_set_url_bad_types_and_missing_files(tmp_path):
    with pytest.raises(TypeError, match=r"^url: expected a str"):
        site.set_url(tmp_path, None)
    with pytest.raises(FileNotFoundError, match=r"^root: expected the project root"):
        site.set_url(tmp_path, "https://github.com/o/r")


def test_set_url_leaves_all_files_alone_when_a_copy_is_missing(tmp_path):
    root = _copy_address_files(tmp_path / "fork")
    text = (root / "pyproject.toml").read_text()
    (root / "pyproject.toml").write_text(re.sub(r"(?m)^Issues = .*\n", "", text))
    before = {name: (root / name).read_text() for name in ADDRESS_FILES}
    with pytest.raises(ValueError, match=r"pyproject.toml \[project.urls\] Issues"):
        site.set_url(root, "https://github.com/o/r")
    assert {name: (root / name).read_text() for name in ADDRESS_FILES} == before


def test_set_url_command_line(tmp_path):
    root = _copy_address_files(tmp_path / "fork")
    env = {**os.environ, "PYTHONPATH": str(REPO / "lib")}
    proc = subprocess.run(
        [sys.executable, "-m", "companion.book.site", "--root", str(root), "set-url",
         "https://github.com/o/r"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "_config.yml html.baseurl: https://o.github.io/r/" in proc.stdout
    assert site.address_copies(root) == site.expected_copies("https://github.com/o/r")
    proc = subprocess.run(
        [sys.executable, "-m", "companion.book.site", "--root", str(root), "set-url", "nope"],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "url: expected a GitHub repository address" in proc.stderr


def test_github_parts_and_derived_addresses():
    assert site.github_parts("https://github.com/o/r.git") == ("o", "r")
    assert site.github_parts("https://github.com/o/r/") == ("o", "r")
    assert site.pages_url_for("https://github.com/O/R") == "https://o.github.io/R/"
    assert site.issues_url("https://github.com/o/r/") == "https://github.com/o/r/issues"


# --------------------------------------------------------------------------- distribution


def test_distribution_is_renamed_and_import_name_stays():
    project = _pyproject()["project"]
    assert project["name"] == site.DISTRIBUTION == "attention-reproduced"
    assert project["optional-dependencies"]["all"] == [f"{site.DISTRIBUTION}[book,nlp,dev]"]
    assert _pyproject()["tool"]["setuptools"]["packages"]["find"]["where"] == ["lib"]
    assert (REPO / "lib" / "companion" / "__init__.py").exists()
    assert site.install_spec("https://github.com/o/r", "abc").startswith(
        f"{site.DISTRIBUTION} @ git+https://github.com/o/r@")
    # no file of the project still names the old distribution as a requirement
    for path in [REPO / "pyproject.toml", REPO / "Makefile", REPO / "environment.yml",
                 REPO / "binder" / "environment.yml", REPO / "binder" / "postBuild",
                 *sorted((REPO / "lib" / "companion").rglob("*.py"))]:
        assert "companion[" not in path.read_text(), path


# --------------------------------------------------------------------------- environments


def _pip_section(path: Path) -> list[str]:
    env = yaml.safe_load(path.read_text())
    assert "python=3.11" in env["dependencies"]
    return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))


def _pyproject_pins() -> set[str]:
    project = _pyproject()["project"]
    pins = set(project["dependencies"])
    for name, extra in project["optional-dependencies"].items():
        if name != "all":
            pins |= set(extra)
    return pins


@pytest.mark.parametrize("path", ["environment.yml", "binder/environment.yml"])
def test_environments_pin_what_pyproject_pins_with_the_cpu_torch(path):
    pip = _pip_section(REPO / path)
    requirements = {p for p in pip if not p.startswith("-")}
    assert requirements == _pyproject_pins()
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9_.+]*", p) for p in requirements)
    assert pip[0] == "--extra-index-url https://download.pytorch.org/whl/cpu"
    options = [p for p in pip if p.startswith("-")]
    if path == "environment.yml":
        assert options[1:] == ["-e ."]  # a clone installs its checkout
    else:
        # repo2docker builds the environment before the repository is there: postBuild
        assert options[1:] == []


def test_binder_post_build_installs_package_corpora_and_kernel():
    post = REPO / "binder" / "postBuild"
    assert post.stat().st_mode & stat.S_IXUSR, "postBuild must be executable"
    text = post.read_text()
    assert text.startswith("#!/bin/bash") and "set -euo pipefail" in text
    if shutil.which("bash"):
        syntax = subprocess.run(["bash", "-n", str(post)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert "python -m pip install --no-deps -e ." in lines
    assert "python -m companion.corpora install" in lines
    assert any(ln.startswith("python -m ipykernel install") and "--name python3" in ln
               for ln in lines)


# --------------------------------------------------------------------------- CITATION.cff


def _cff_validator() -> jsonschema.Draft7Validator:
    schema = json.loads((REPO / "tests" / "fixtures" / "cff-1.2.0.schema.json").read_text())
    assert schema["$id"] == "https://citation-file-format.github.io/1.2.0/schema.json"
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.FormatChecker())


def test_citation_cff_is_valid_cff_1_2_0():
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in _cff_validator().iter_errors(cff)]
    assert errors == []
    assert cff["cff-version"] == "1.2.0"
    assert cff["version"] == _pyproject()["project"]["version"]
    datetime.date.fromisoformat(cff["date-released"])
    # the authors are one entity, not a person with the surname "Attention"
    assert cff["authors"] == [{"name": "Attention, Reproduced contributors"}]
    assert cff["repository-code"] == site.repository_url(REPO)
    assert cff["url"] == site.pages_url_for(site.repository_url(REPO))


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("authors"), "'authors' is a required property"),
    (lambda c: c.update({"date-released": "2026-13-01"}), "is not a 'date'"),
    (lambda c: c.update({"authors": [{"family-names": 3}]}), "is not valid under any of"),
    (lambda c: c.update({"repository-code": 7}), "7 is not of type 'string'"),
])
def test_cff_schema_check_catches_broken_files(change, message):
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    change(cff)
    messages = [e.message for e in _cff_validator().iter_errors(cff)]
    assert any(message in m for m in messages), messages


# --------------------------------------------------------------------------- PDF


def test_latex_builder_puts_markdown_first_so_figures_keep_captions():
    from myst_nb.core.render import get_mime_priority

    overrides = [tuple(o) for o in _config()["sphinx"]["config"]["nb_mime_priority_overrides"]]
    for builder in ("html", "latex"):
        order = get_mime_priority(builder, overrides)
        assert order.index("text/markdown") < order.index("image/png"), builder
    # what the override fixes: myst-nb's own latex order shows the bare PNG
    plain = get_mime_priority("latex", [])
    assert plain.index("image/png") < plain.index("text/markdown")
    assert _config()["latex"]["latex_engine"] == "xelatex"


def _makefile_variable(name: str) -> str:
    text = (REPO / "Makefile").read_text()
    match = re.search(rf"^{name} := ((?:[^\n]*\\\n)*[^\n]*)$", text, re.M)
    assert match, name
    return " ".join(match.group(1).replace("\\\n", " ").split())


def test_make_pdf_builds_with_the_latex_builder_and_the_intro_links_it():
    text = (REPO / "Makefile").read_text()
    recipe = text.split("\npdf:", 1)[1].split("\n\n", 1)[0]
    assert "jupyter-book build . --path-output book --builder pdflatex" in recipe
    name = _makefile_variable("PDF_NAME")
    assert "build_html(Project('.'))" in recipe and "book/_build/html/$(PDF_NAME)" in recipe
    # book/intro.md is built to html/book/intro.html; the PDF sits at the site's root,
    # where book/_ext/pdf_link.py copies it, in a container it keeps only with a PDF
    intro = (REPO / "book" / "intro.md").read_text()
    link = intro.split("```{container} pdf-link\n", 1)[1].split("```", 1)[0]
    assert f'href="../{name}"' in link
    assert _pdf_link_module().PDF_NAME == name
    assert "pdf" in re.search(r"^\.PHONY: (.*)$", text, re.M).group(1).split()


def test_make_pdf_without_tex_and_root_names_the_debian_packages(tmp_path):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_id = bin_dir / "id"  # not root, and no latexmk/xelatex on PATH
    fake_id.write_text("#!/bin/sh\necho 1000\n")
    fake_id.chmod(0o755)
    proc = subprocess.run([make, "-s", "-C", str(REPO), "latex"], capture_output=True,
                          text=True, env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
                          timeout=60)
    assert proc.returncode != 0
    assert "latexmk and xelatex are missing" in proc.stderr
    for package in _makefile_variable("TEX_PACKAGES").split():
        assert package in proc.stderr


def test_every_make_target_the_workflow_runs_exists():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", makefile, re.M))
    runs = "\n".join(s.get("run", "") for job in _workflow()["jobs"].values()
                     for s in job["steps"])
    used = set(re.findall(r"^\s*make ([A-Za-z0-9_.-]+)", runs, re.M))
    assert used >= {"publish", "pdf"}
    assert used <= targets, used - targets


def test_the_wheel_is_attention_reproduced_and_holds_companion(tmp_path):
    """Build the distribution from a copy of the checkout (no network, no build isolation)."""
    import zipfile

    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    shutil.copytree(REPO / "lib", src / "lib",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    version = _pyproject()["project"]["version"]
    wheel = tmp_path / "dist" / f"attention_reproduced-{version}-py3-none-any.whl"
    assert wheel.exists(), sorted(p.name for p in (tmp_path / "dist").iterdir())
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"attention_reproduced-{version}.dist-info/METADATA").decode()
    assert "companion/__init__.py" in names and "companion/book/site.py" in names
    assert not any(n.startswith("lib/") for n in names)
    assert f"Name: {site.DISTRIBUTION}\n" in metadata
    repository = site.repository_url(REPO)
    assert f"Project-URL: Repository, {repository}\n" in metadata
    assert f"Requires-Dist: {site.DISTRIBUTION}[book,dev,nlp]; extra == \"all\"" in metadata


def _extension(name: str):
    import importlib.util

    path = REPO / "book" / "_ext" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _latex_tables_module():
    return _extension("latex_tables")


def _pdf_link_module():
    return _extension("pdf_link")


_TABLES_RST = """
.. table:: A captioned table

   ====  ==========================================
   key   value
   ====  ==========================================
   a     a rather long statement that has to wrap
   ====  ==========================================

.. note::

   ===  ===
   x    y
   ===  ===
   1    2
   ===  ===

===  ===
p    q
===  ===
1    2
===  ===

+---+---+
| spans |
+---+---+
| 1 | 2 |
+---+---+
"""


@pytest.mark.parametrize("builder_format", ["latex", "html"])
def test_pdf_tables_become_longtables_with_widths_and_keep_their_numbers(builder_format):
    from types import SimpleNamespace

    from docutils import nodes
    from docutils.core import publish_doctree

    module = _latex_tables_module()
    doctree = publish_doctree(_TABLES_RST, settings_overrides={"report_level": 5})
    captioned, in_note, plain, spanning = list(doctree.findall(nodes.table))
    app = SimpleNamespace(builder=SimpleNamespace(format=builder_format))
    module.mark_tables_long(app, doctree, "index")
    raws = [r.astext() for r in doctree.findall(nodes.raw)]
    if builder_format == "html":
        assert all("longtable" not in t["classes"] for t in (captioned, in_note, plain))
        assert raws == []
        return
    for table in (captioned, plain, spanning):
        assert "longtable" in table["classes"]
    assert "longtable" not in in_note["classes"]  # longtable cannot go in an admonition
    widths = [c["colwidth"] for c in captioned.findall(nodes.colspec)]
    assert widths == [4, len("a rather long statement that has to wrap")]
    assert "colwidths-given" in captioned["classes"] and "colwidths-given" in plain["classes"]
    assert "colwidths-given" not in spanning["classes"]  # spans: Sphinx's own layout
    # the counter is stepped back after the two uncaptioned longtables only
    assert raws == ["\\addtocounter{table}{-1}\n"] * 2
    assert isinstance(plain.next_node(descend=False, siblings=True), nodes.raw)
    assert not isinstance(captioned.next_node(descend=False, siblings=True), nodes.raw)
    assert module.column_widths(spanning) is None


def test_the_pdf_table_extension_is_configured():
    config = _config()["sphinx"]
    assert config["local_extensions"]["latex_tables"] == "book/_ext"
    assert (REPO / "book" / "_ext" / "latex_tables.py").exists()


def _sphinx_build(src: Path, out: Path, builder: str) -> None:
    from sphinx.cmd.build import build_main

    assert build_main(["-q", "-W", "-b", builder, "-d", str(out.parent / ".doctrees"),
                       str(src), str(out)]) == 0


def test_pdf_link_follows_the_pdf_and_the_site_carries_it(tmp_path):
    module = _pdf_link_module()
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO / 'book' / '_ext')!r})\n"
        "extensions = ['pdf_link']\n")
    (src / "index.rst").write_text(
        "Book\n====\n\n.. container:: pdf-link\n\n   The whole book as one PDF_.\n\n"
        f".. _PDF: {module.PDF_NAME}\n\nAfter the link.\n")
    build = tmp_path / "_build"
    html = build / "html"
    _sphinx_build(src, html, "html")
    page = (html / "index.html").read_text()
    assert "After the link." in page and "pdf-link" not in page  # no PDF: no link
    assert not (html / module.PDF_NAME).exists()

    (build / "latex").mkdir()
    (build / "latex" / "book.pdf").write_bytes(b"%PDF-1.5 test")
    _sphinx_build(src, html, "html")  # incremental: the page is read again
    page = (html / "index.html").read_text()
    assert "pdf-link" in page and f'href="{module.PDF_NAME}"' in page
    assert (html / module.PDF_NAME).read_bytes() == b"%PDF-1.5 test"

    _sphinx_build(src, build / "latex", "latex")  # the PDF never links itself
    tex = next((build / "latex").glob("*.tex")).read_text()
    assert "After the link." in tex and "The whole book as one" not in tex

    (build / "latex" / "book.pdf").unlink()
    _sphinx_build(src, html, "html")
    assert "pdf-link" not in (html / "index.html").read_text()
