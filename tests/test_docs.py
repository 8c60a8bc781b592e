"""The README and the docs/ guides hold: every `docs/...` path that code, tests, configs or the docs cite is a file of
the repository, and every section of a docs/*.md file cited by its title is a heading of that file; every relative
link and `#anchor` of the README and docs/*.md resolves; every ```python snippet runs (or says what it needs) and
every ```sh command parses with its tool's own parser (configs loaded with their overrides); the README stays
short and names every guide."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
# docs/<name>.md followed by , "<title>" or ("<title>" or , section "<title>" (backticks and escaped quotes
# allowed), and "<title>" in docs/<name>.md.
CITATION_AFTER = re.compile(r'docs/([\w-]+\.md)`?(?:, section |, |\s*\(|\s+)\\?"([^"\\\n]+)\\?"')
CITATION_BEFORE = re.compile(r'"([^"\n]+)" in `?docs/([\w-]+\.md)')
PATH = re.compile(r"\bdocs/[\w-]+(?:/[\w-]+)*\.[A-Za-z]+")


def _sources():
    for folder in ("uvic", "kernels", "fid", "tests", "benchmarks"):
        yield from (ROOT / folder).rglob("*.py")
    yield from (ROOT / "configs").glob("*.yaml")
    yield from (ROOT / "docs").glob("*.md")
    yield from (ROOT / name for name in ("README.md", "train.py", "sample.py", "Makefile", "pyproject.toml"))


def _cited_sections() -> dict[tuple[str, str], list[str]]:
    cited = {}
    for path in _sources():
        text, where = path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()
        for doc, section in CITATION_AFTER.findall(text):
            cited.setdefault((doc, section), []).append(where)
        for section, doc in CITATION_BEFORE.findall(text):
            cited.setdefault((doc, section), []).append(where)
    return cited


def test_cited_docs_paths_exist():
    cited = {}
    for path in _sources():
        for m in PATH.finditer(path.read_text(encoding="utf-8")):
            cited.setdefault(m.group(0), []).append(path.relative_to(ROOT).as_posix())
    assert {"docs/conventions.md", "docs/attention.md", "docs/kernel_math.md"} <= set(cited)  # the pattern works
    missing = {p: files for p, files in cited.items() if not (ROOT / p).is_file()}
    assert not missing, f"cited docs paths that are not in the repository: {missing}"


def test_cited_sections_exist():
    cited = _cited_sections()
    docs = {doc for doc, _ in cited}
    assert {"conventions.md", "attention.md", "kernel_math.md"} <= docs  # the patterns find the citations at all
    assert sum(doc == "conventions.md" for doc, _ in cited) >= 8
    headings = {doc: {line.lstrip("#").strip() for line in (ROOT / "docs" / doc).read_text().splitlines()
                      if re.match(r"#{2,6} ", line)} for doc in docs}
    missing = {f"{doc}: {section}": files for (doc, section), files in cited.items() if section not in headings[doc]}
    assert not missing, f"cited sections that the docs do not have: {missing}"


# The pages a reader reads: the README and the guides and notes under docs/.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDES = ["training", "sampling", "fid", "comparisons", "language_models", "cog_in_your_model", "kernel",
          "benchmarks", "results"]


def _page(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _blocks(path: Path, langs: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line number, code) of every fenced block of one of `langs` (```python, ```sh, ...) of a page."""
    lines, out, start, lang = path.read_text(encoding="utf-8").splitlines(), [], None, None
    for i, line in enumerate(lines, 1):
        if start is None and line.startswith("```"):
            start, lang = i, line[3:].strip()
        elif start is not None and line.strip() == "```":
            if lang in langs:
                out.append((start, "\n".join(lines[start:i - 1])))
            start = None
    return out


def _snippets() -> list[tuple[str, int, str]]:
    """(page, line number, code) of every ```python block of the README and of docs/*.md."""
    return [(_page(path), n, code) for path in PAGES for n, code in _blocks(path, ("python",))]


# A snippet that needs what a test cannot have (downloaded weights, a trained run) says so in its first line,
# visibly: "# Needs: ...". Every other snippet runs as written.
NEEDS = "# Needs: "


def test_the_guides_exist_and_the_readme_names_each():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in GUIDES:
        text = (ROOT / "docs" / f"{name}.md").read_text(encoding="utf-8")
        assert text.startswith("# "), f"docs/{name}.md does not open with a # title"
        assert f"](docs/{name}.md)" in readme, f"the README's guide list does not link docs/{name}.md"


def test_the_readme_stays_short():
    """The README is what uvic is, the quickstart, the results, the map and the guides; the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 320, f"README.md has {len(lines)} lines: move detail into a guide under docs/"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:4] == ["## Quickstart", "## Results", "## Repository map", "## Guides"], headings


def test_the_readme_test_command_is_what_ci_runs():
    """The quickstart's test command is the one CI runs (.ci/run ends with it), so a green CI means that command passes."""
    quickstart = (ROOT / "README.md").read_text(encoding="utf-8").split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    readme = [c for code in re.findall(r"```sh\n(.*?)```", quickstart, re.S) for c in _commands(code)]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ["make", "test"] in readme and ci[-1] == "make test", (readme, ci[-1])


def test_the_python_snippets_that_need_nothing_run(tmp_path, monkeypatch):
    snippets = _snippets()
    runnable = [(page, n, code) for page, n, code in snippets if not code.startswith(NEEDS)]
    assert len(runnable) >= 3 and len(snippets) > len(runnable) + 5  # both kinds are found
    assert {page for page, _, _ in snippets} >= {"README.md", "docs/kernel.md", "docs/training.md",
                                                 "docs/sampling.md", "docs/fid.md", "docs/language_models.md"}
    monkeypatch.chdir(tmp_path)
    for page, n, code in runnable:
        try:
            exec(compile(code, f"{page}:{n}", "exec"), {"__name__": "readme"})
        except Exception as e:  # noqa: BLE001 - report which snippet failed
            raise AssertionError(f"the snippet at {page}:{n} fails: {type(e).__name__}: {e}") from e


def test_the_snippets_that_need_more_say_what():
    for page, n, code in _snippets():
        if code.lstrip().startswith("# Needs") or "Needs:" in code.splitlines()[0]:
            assert code.startswith(NEEDS) and len(code.splitlines()[0]) > len(NEEDS) + 5, f"{page}:{n}"


# The first line of an indented block that holds a command or Python (formulas and messages may stay indented).
COMMAND_OR_CODE = re.compile(r"(?:[A-Z_]+=\S+ )*(?:python3?|accelerate|make|torchrun|pip|sbatch|from|import)\b")


def test_commands_and_code_are_fenced():
    """Commands and code sit in fenced blocks, which the tests read; an indented block would escape them."""
    indented = []
    for path in PAGES:
        lines, fenced = path.read_text(encoding="utf-8").splitlines(), False
        for i, line in enumerate(lines):
            fenced ^= line.startswith("```")
            if (not fenced and line.startswith("    ") and not lines[i - 1].strip()
                    and COMMAND_OR_CODE.match(line.strip())):
                indented.append(f"{_page(path)}:{i + 1}")
    assert not indented, f"indented command or code blocks (fence them: ```sh, ```python): {indented}"


# --- shell commands --------------------------------------------------------------------------------------------
# Every command of a ```sh block of the README and the guides is checked without running it: the program is one
# this repository has (a make target, a script, a module) or one of a few outside tools; the arguments parse with
# the tool's own argparse parser, run in-process up to its parse_args; and the config of a train.py or compare.py
# command loads with its overrides (and each arm's), as the command would load it.
SHELL_LANGS = ("sh", "bash", "shell", "console")
OUTSIDE_TOOLS = {"pip", "sbatch", "tensorboard", "torchrun", "nvidia-smi"}  # not ours: not checked beyond the name
ACCELERATE_FLAGS = {"--multi_gpu", "-q", "--quiet", "--cpu", "-m", "--module"}  # the launch options without a value


class _Parsed(Exception):
    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def _commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, split at &&, ;, | and
    redirections (whose targets are dropped), leading VAR=value assignments dropped."""
    import shlex

    logical, pending = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            logical.append(pending + line)
            pending = ""
    commands = []
    for line in logical:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command, skip = [], False
        for token in [*lexer, ";"]:
            if skip:
                skip = False
            elif token in (">", ">>", "<", "2>"):
                skip = True
            elif token in ("&&", "||", ";", "|", "&"):
                while command and re.fullmatch(r"[A-Za-z_]\w*=\S*", command[0]):
                    command.pop(0)
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(token)
    return commands


def _parse_cli(run, argv: list[str], where: str):
    """Run a CLI in-process with sys.argv = argv until its parser has parsed: the namespace, or an
    AssertionError with argparse's own message."""
    import argparse
    import contextlib
    import io
    import sys
    import warnings

    originals = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_intermixed_args")}

    def stop_after(name):
        def parse(self, args=None, namespace=None):
            raise _Parsed(originals[name](self, args, namespace))
        return parse

    err, old_argv = io.StringIO(), sys.argv
    try:
        for name in originals:
            setattr(argparse.ArgumentParser, name, stop_after(name))
        sys.argv = argv
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # runpy: the module was imported before it runs as __main__
            run()
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as e:
        raise AssertionError(f"{where}: `{' '.join(argv)}` does not parse (exit {e.code}): {err.getvalue().strip()}") from None
    finally:
        sys.argv = old_argv
        for name, f in originals.items():
            setattr(argparse.ArgumentParser, name, f)
    raise AssertionError(f"{where}: `{' '.join(argv)}` ran without parsing any arguments")


def _check_config(config: str, overrides: list[str], where: str):
    from uvic.config import load_config

    if config.endswith((".yaml", ".yml")):  # a run dir in its place is made by training
        assert (ROOT / config).is_file(), f"{where}: {config} is not a file of the repository"
        try:
            load_config(str(ROOT / config), overrides)
        except (ValueError, FileNotFoundError) as e:  # ConfigError included
            raise AssertionError(f"{where}: {config} {' '.join(overrides)}: {e}") from None


def _check_python(args: list[str], where: str):
    import importlib.util
    import runpy

    if args[0] == "-m":
        module, rest = args[1], args[2:]
        spec = importlib.util.find_spec(module if module != "uvic.fid" else "uvic.fid.__main__")
        assert spec is not None, f"{where}: no module {module}"
        if module == "pytest":
            assert all((ROOT / a).exists() for a in rest if a.startswith("tests/")), f"{where}: {rest}"
            return
        if "ArgumentParser" not in Path(spec.origin).read_text(encoding="utf-8"):
            return  # hands its arguments to another tool (uvic.lm.eval: lm-eval's own CLI)
        _parse_cli(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True), [module, *rest], where)
        return
    script, rest = args[0], args[1:]
    assert (ROOT / script).is_file(), f"{where}: {script} is not a file of the repository"
    ns = _parse_cli(lambda: runpy.run_path(str(ROOT / script), run_name="__main__"), [script, *rest], where)
    if script == "train.py":
        extra = [v for v in (ns.resume, ns.export) if v and "=" in v]  # `--resume key=value` is an override
        _check_config(ns.config, [*ns.overrides, *extra], where)
    elif script == "compare.py" and ns.command in ("run", "plan"):
        for arm in ns.arm:
            _check_config(ns.config, [*ns.overrides, *arm[1:]], f"{where} (arm {arm[0]})")


def _check_command(argv: list[str], where: str):
    program, args = argv[0], argv[1:]
    if program == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        assert args and set(args) <= targets, f"{where}: make {args}: not targets of the Makefile {sorted(targets)}"
    elif program in ("python", "python3"):
        _check_python(args, where)
    elif program == "accelerate":
        assert args[0] == "launch", f"{where}: accelerate {args[0]}"
        i, module = 1, False
        while args[i].startswith("-"):
            module |= args[i] in ("-m", "--module")
            i += 1 if args[i] in ACCELERATE_FLAGS or "=" in args[i] else 2
        _check_python(["-m", *args[i:]] if module else args[i:], where)
    else:
        assert program in OUTSIDE_TOOLS or (ROOT / program).is_file(), f"{where}: unknown program {program!r}"


def test_the_shell_commands_parse(tmp_path, monkeypatch):
    blocks = [(_page(path), n, code) for path in PAGES for n, code in _blocks(path, SHELL_LANGS)]
    commands = [(f"{page}:{n}", c) for page, n, code in blocks for c in _commands(code)]
    programs = {c[0] for _, c in commands}
    assert len(commands) >= 40 and {"make", "python", "accelerate"} <= programs  # the blocks are found
    assert {page for page, _, _ in blocks} >= {"README.md", "docs/training.md", "docs/fid.md", "docs/comparisons.md"}
    monkeypatch.chdir(tmp_path)  # nothing a command names needs to exist here; configs are read from the repository
    for where, argv in commands:
        _check_command(argv, where)


def test_the_shell_command_check_fails_on_bad_commands():
    """The check is not vacuous: an unknown option, an unknown config key, a missing script or make target fail."""
    import pytest

    for bad in ["python train.py configs/demo_digits.yaml --no-such-option",
                "python train.py configs/demo_digits.yaml train.no_such_key=1",
                "python compare.py run configs/demo_digits.yaml --arm a model.depth=oops --seeds 0 --out x",
                "python -m uvic.fid score",
                "python nope.py", "make no-such-target", "frobnicate --all"]:
        with pytest.raises(AssertionError):
            for argv in _commands(bad):
                _check_command(argv, bad)
    assert _commands("A=1 python x.py a \\\n  b  # c && d\nmake t > out.txt && echo 'p | q'") == [
        ["python", "x.py", "a", "b"], ["make", "t"], ["echo", "p | q"]]


# --- links -----------------------------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens, -1, -2 on repeats."""
    seen, fenced = {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def _links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)  # not in code
    return LINK.findall(text)


def _broken_links(pages) -> list[str]:
    broken = []
    for path in pages:
        for target in _links(path):
            if re.match(r"[a-z]+:", target):  # https:, mailto: - outside the repository
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{_page(path)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
                broken.append(f"{_page(path)}: {target} (no such heading)")
    return broken


def test_the_internal_links_resolve():
    links = [link for path in PAGES for link in _links(path)]
    assert len(links) >= 40 and sum("#" in link for link in links) >= 10  # the pattern finds them
    broken = _broken_links(PAGES)
    assert not broken, f"links to files or headings that do not exist: {broken}"


def test_the_link_check_fails_on_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Two words (`x`)\n\n## Two words (`x`)\n")
    (tmp_path / "b.md").write_text("[ok](a.md) [ok](a.md#two-words-x) [ok](a.md#two-words-x-1) [ok](#b) "
                                   "[x](https://example.org/#z)\n\n# B\n\n```sh\n[not a link](nowhere.md)\n```\n")
    (tmp_path / "c.md").write_text("[bad](a.md#two-words) [bad](missing.md) ![bad](img.png) [bad](#c-1)\n# C\n")
    assert _broken_links([tmp_path / "b.md"]) == []
    broken = [b.split(": ", 1)[1] for b in _broken_links([tmp_path / "c.md"])]
    assert broken == ["a.md#two-words (no such heading)", "missing.md (no such file)", "img.png (no such file)",
                      "#c-1 (no such heading)"]


def test_the_repository_map_points_to_module_docstrings():
    """The README's repository map names paths and sends the reader to each module's docstring: every path it names
    exists, and every Python module under them (the tests aside) opens with a docstring."""
    import ast

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Repository map\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    cells = [row.split(" | ")[0] for row in rows]
    paths = [p for cell in cells for p in re.findall(r"`([^`\s]+)`", cell) if not p.startswith("uvic.")]
    assert len(paths) >= 15 and "uvic/schedulers/" in paths
    assert not [p for p in paths if not (ROOT / p).exists()], "paths in the repository map that do not exist"
    modules = [f for p in paths if p.endswith(("/", ".py")) and p != "tests/" for f in
               ([ROOT / p] if p.endswith(".py") else (ROOT / p).rglob("*.py"))]
    assert len(modules) > 50
    bare = [f.relative_to(ROOT).as_posix() for f in modules if not ast.get_docstring(ast.parse(f.read_text()))]
    assert not bare, f"modules without a docstring: {bare}"



def test_compare_help_examples_are_the_guides():
    """compare.py --help shows commands that docs/comparisons.md gives too, word for word (the cluster launcher
    included)."""
    import ast

    doc = ast.get_docstring(ast.parse((ROOT / "compare.py").read_text(encoding="utf-8")))
    guide = (ROOT / "docs" / "comparisons.md").read_text(encoding="utf-8")
    given = [c for code in re.findall(r"```sh\n(.*?)```", guide, re.S) for c in _commands(code)]
    indented = "\n".join(line for line in doc.splitlines() if line.startswith("    "))  # the examples' block
    examples = [c for c in _commands(indented) if "compare.py" in c]
    assert len(examples) >= 4 and any("--launcher" in c for c in examples)
    # The report command of --gen-seeds ends with the first of its --fid values in the guide's, more after it.
    missing = [" ".join(c) for c in examples if not any(g[:len(c)] == c for g in given)]
    assert not missing, f"compare.py --help examples that docs/comparisons.md does not give: {missing}"
