"""The README and docs/ hold together: every link between pages reaches a page and a heading that exist,
every Shoal command in a shell block is one the command line accepts (parsed by the server's and
shoal-load's own parsers, not run), and every bench script the pages name exists and takes the flags
written with it. The examples that can run here run elsewhere, as written: docs/http.md's in
test_http_readme.py, docs/clients.md's shoal-load commands in test_loadtest.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal import cli
from shoal.backends.devices import cuda_device_count
from shoal.clients.loadtest import cli as load_cli
from tests import models
from tests.conftest import RunningServer, serving
from tests.models import REPO_ROOT

PAGES = [
    REPO_ROOT / "README.md",
    *sorted((REPO_ROOT / "docs").glob("*.md")),
    REPO_ROOT / "bench" / "README.md",
    REPO_ROOT / "tests" / "README.md",
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
SHELL = {"bash", "sh", "shell", "console"}


def _prose(text: str) -> str:
    """The page without its fenced code blocks (a ``#`` there is a comment, a ``[x](y)`` is code)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped but ``-`` and ``_``, spaces to ``-``."""
    text = re.sub(r"`|\*\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.*)$", _prose(page.read_text()), flags=re.M):
        slug = base = _slug(heading)
        counter = 0
        while slug in found:  # GitHub numbers a repeated heading's anchor
            counter += 1
            slug = f"{base}-{counter}"
        found.add(slug)
    return found


def _links(page: Path) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(page.read_text()))


def test_the_pages_are_found() -> None:
    assert len(PAGES) >= 12 and all(page.is_file() for page in PAGES)
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 250  # a landing page, not the manual


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_link_reaches_a_page_and_a_heading_that_exist(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):  # https:, mailto: - outside the repository
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(REPO_ROOT) if target.is_relative_to(REPO_ROOT) else target}")
        elif anchor and (target.suffix != ".md" or anchor not in _anchors(target)):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, f"{page.name}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_repository_path_a_page_names_exists(page: Path) -> None:
    """A file named in inline code (``tests/...py``, ``bench/...py``, ``server/shoal/...py``, ``deploy/...``) is
    there."""
    named = re.findall(r"`((?:tests|bench|server|clients|deploy|docs|proto)/[\w./-]+\.\w+)`", _prose(page.read_text()))
    written = [path for path in named if not path.startswith("bench/results/")]  # a script's output: git-ignored
    missing = sorted({path for path in written if not (REPO_ROOT / path).exists()})
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def _shell_commands() -> list[tuple[str, list[str]]]:
    """Every command of every shell block, split at ``&&``, ``||``, ``;`` and ``|``; environment
    assignments before it dropped; (page, argv)."""
    found = []
    for page in PAGES:
        for language, block in FENCE.findall(page.read_text()):
            if language not in SHELL:
                continue
            for command in _lines(block.replace("\\\n", " ")):
                lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
                lexer.whitespace_split, lexer.commenters = True, "#"
                argv: list[str] = []
                for token in [*lexer, ";"]:
                    if token and set(token) <= set(";&|"):
                        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                            argv = argv[1:]
                        if argv:
                            found.append((page.name, argv))
                        argv = []
                    else:
                        argv.append(token)
    return found


def _lines(block: str) -> list[str]:
    """The block's command lines: a line whose quote is still open goes on with the next one."""
    lines: list[str] = []
    pending = ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # "No closing quotation": the quoted text goes on
            continue
        lines.append(pending)
        pending = ""
    assert not pending, f"a shell block ends inside a quote: {pending!r}"
    return lines


def _parses(parser: argparse.ArgumentParser, args: list[str]) -> str:
    """ "" when ``parser`` accepts ``args``, else what it said."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exit:
        return "" if exit.code == 0 else said.getvalue().strip().splitlines()[-1]
    return ""


def test_every_shoal_command_in_a_shell_block_is_one_the_command_line_accepts() -> None:
    checked, refused = 0, []
    for page, argv in _shell_commands():
        program = argv[0].rsplit("/", 1)[-1]
        if program == "shoal":
            parser, args = cli.build_parser(), argv[1:]
        elif program == "shoal-load":
            parser, args = load_cli.build_parser(), argv[1:]
        elif program.startswith("python") and argv[1:3] == ["-m", "shoal"]:
            parser, args = cli.build_parser(), argv[3:]
        else:
            continue
        checked += 1
        if why := _parses(parser, args):
            refused.append(f"{page}: {shlex.join(argv)}\n    {why}")
    assert checked >= 6, checked  # the pages do hold such commands: a parse that finds none is broken
    assert not refused, "\n".join(refused)


def _bench_commands() -> list[tuple[str, list[str]]]:
    """``python bench/x.py ...`` in shell blocks and in inline code."""
    found = [(page, argv[1:]) for page, argv in _shell_commands() if argv[0].rsplit("/", 1)[-1].startswith("python")]
    for page in PAGES:
        for inline in re.findall(r"`((?:\.venv/bin/)?python3? bench/[^`]*)`", _prose(page.read_text())):
            found.append((page.name, shlex.split(inline)[1:]))
    # bench/NAME.py: a placeholder for any script
    return [
        (page, args) for page, args in found if args and args[0].startswith("bench/") and args[0] != "bench/NAME.py"
    ]


def test_every_bench_command_names_a_script_that_takes_its_flags() -> None:
    commands = _bench_commands()
    assert len(commands) >= 30, len(commands)
    wrong = []
    for page, (script, *args) in commands:
        path = REPO_ROOT / script
        if not path.is_file():
            wrong.append(f"{page}: {script} does not exist")
            continue
        source = path.read_text()
        for flag in (arg.split("=", 1)[0] for arg in args if arg.startswith("--")):
            if f'"{flag}"' not in source:
                wrong.append(f"{page}: {script} takes no {flag}")
    assert not wrong, "\n".join(wrong)


def test_the_readmes_first_request_runs_as_written(tmp_path: Path, server_factory) -> None:
    """The README's gRPC example against the example repository's ``simple`` on a real server."""
    text = (REPO_ROOT / "README.md").read_text()
    (block,) = [code for language, code in FENCE.findall(text) if language == "python"]
    assert "localhost:8001" in block
    server = server_factory(models.repository(tmp_path, "simple"))
    result = subprocess.run(
        [sys.executable, "-c", block.replace("localhost:8001", server.url)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    printed, index = result.stdout.split("\n", 1)[0], result.stdout.split("\n", 1)[1]
    assert [int(n) for n in re.findall(r"-?\d+", printed)] == list(range(1, 17))  # a + 1
    assert "simple" in index and "READY" in index


# -- the Python examples of docs/, run against the shipped repository --------------------------------

EXAMPLE_MODELS = [path.name for path in models.EXAMPLES.iterdir() if (path / "config.pbtxt").is_file()]
NEEDS_A_GPU = "cuda_shared_memory"  # such an example runs on a GPU host only (the gpu-marked tests)


def _python_examples() -> list[tuple[str, str]]:
    """(page and index, code) of every Python block in docs/ that talks to a server on localhost:8001."""
    found = []
    for page in sorted((REPO_ROOT / "docs").glob("*.md")):
        blocks = [code for language, code in FENCE.findall(page.read_text()) if language == "python"]
        found += [(f"{page.name}[{index}]", code) for index, code in enumerate(blocks) if "localhost:8001" in code]
    return found


@pytest.fixture(scope="module")
def shipped_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """``shoal serve --model-repository model_repository``, as the README's first command runs it."""
    repo = tmp_path_factory.mktemp("repo")
    for name in EXAMPLE_MODELS:
        models.copy_example(repo, name)
    with serving(repo, tmp_path_factory.mktemp("server")) as server:
        yield server


def test_the_docs_hold_python_examples() -> None:
    assert len(_python_examples()) >= 5


@pytest.mark.parametrize(("where", "code"), _python_examples(), ids=lambda value: value if ".md" in value else "")
def test_each_python_example_of_the_docs_runs_as_written(shipped_server: RunningServer, where: str, code: str) -> None:
    if NEEDS_A_GPU in code:
        if cuda_device_count() == 0:
            pytest.skip("a CUDA shared-memory example: it runs on a host with a CUDA device")
        pytest.importorskip("tritonclient.utils.cuda_shared_memory", reason="needs cuda-python (the gpu extra)")
    result = subprocess.run(
        [sys.executable, "-c", code.replace("localhost:8001", shipped_server.url)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{where}:\n{result.stderr}"
    # A print whose comment is its exact output (``print(x.shape)  # (1, 256)``) must print just that.
    promised = [
        comment.strip()
        for line in code.splitlines()
        if line.startswith("print(") and (comment := line.partition(")  # ")[2]) and re.fullmatch(r"[\w(), ]+", comment)
    ]
    for expected in promised:
        assert expected in result.stdout.splitlines(), (where, expected, result.stdout)
