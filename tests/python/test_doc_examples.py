"""Every code block of README.md and docs/*.md runs as written, on the CPU backend, so the
docs and the behaviour cannot drift apart (docs/testing.md, "The docs' code blocks").

A block is a fenced ```python, ```bash or ```cpp block; a fence without a language is
output or text and is not run. An HTML comment on the lines just before the fence, invisible
in the rendered page, says how a block is run:

    <!-- megamoe-doc: DIRECTIVE; DIRECTIVE ...
    setup code (optional: run before the block, in the block's language)
    -->

Directives:
    skip: REASON        not run (a build, a download, a placeholder that cannot exist here);
                        the last directive: the reason runs to the end of the line
    gpu                 needs a CUDA GPU (graphs, the kernel, NCCL): not run on the CPU
    fragment            C++: part of a program (declarations from around it); not compiled
    replace OLD NEW     run with every OLD replaced by NEW (shell-quoted words), e.g. a model
                        path by the test checkpoint or "cuda" by "cpu"

python blocks run in a fresh interpreter with the built package (PYTHONPATH, as
scripts/test_python.sh sets it); the setup sees CKPT (a small synthetic GLM-5 checkpoint,
MoE layer 3) and CLI (build/megamoe). A block that uses torch is skipped where torch is
missing (scripts/test_python_hf.sh runs this file again with torch). bash blocks run with
bash -euo pipefail from the repository root (build/megamoe, scripts/) with DOC_TMP, TMPDIR and
HOME in a fresh temporary folder, CKPT and CLI set, and build/venv's python first on PATH.
cpp blocks that are whole programs (an `int main`) are compiled against include/; the others
must be marked `fragment`.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
MARK = re.compile(r"<!--\s*megamoe-doc:(.*?)-->", re.S)
FENCE = re.compile(r"^```(\S*)\s*$")
LANGS = {"python", "bash", "cpp"}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str = ""  # why the block is not run ("" when it is)
    gpu: bool = False
    fragment: bool = False
    replace: List[Tuple[str, str]] = field(default_factory=list)
    setup: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def text(self) -> str:
        code = self.code
        for old, new in self.replace:
            assert old in code, f"{self.id}: 'replace {old} {new}': the block has no {old!r}"
            code = code.replace(old, new)
        return code


def parse_directives(b: Block, comment: str) -> None:
    head, _, setup = comment.partition("\n")
    b.setup = setup
    head, colon, reason = head.partition("skip:")  # the reason runs to the end of the line
    if colon:
        b.skip = reason.strip()
        assert b.skip, f"{b.id}: 'skip' needs a reason ('skip: why')"
    for d in filter(None, (d.strip() for d in head.split(";"))):
        word, _, rest = d.partition(" ")
        if word == "gpu":
            b.gpu = True
        elif word == "fragment":
            b.fragment = True
        elif word == "replace":
            args = shlex.split(rest)
            assert len(args) == 2, f"{b.id}: 'replace OLD NEW' takes two words, found {rest!r}"
            b.replace.append((args[0], args[1]))
        else:
            raise AssertionError(f"{b.id}: unknown megamoe-doc directive {d!r} (tests/python/test_doc_examples.py)")


def blocks() -> List[Block]:
    out = []
    for path in DOCS:
        text = path.read_text()
        lines = text.split("\n")
        # Where each comment ends (line index) -> its body, for the fence after it.
        comments = {}
        for m in MARK.finditer(text):
            comments[text.count("\n", 0, m.end())] = m.group(1)
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            b = Block(path, i + 1, m.group(1), "\n".join(lines[i + 1 : j]) + "\n")
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            if k in comments:
                parse_directives(b, comments[k])
            if b.lang:
                out.append(b)
            i = j + 1
    return out


BLOCKS = blocks()


def test_every_block_has_a_known_language():
    bad = [b.id + " ```" + b.lang for b in BLOCKS if b.lang not in LANGS]
    assert not bad, f"code blocks in a language the docs test does not run (python, bash, cpp): {bad}"


@pytest.fixture(scope="session")
def doc_env(tmp_path_factory):
    cli = os.environ.get("MEGAMOE_CLI") or str(ROOT / "build" / "megamoe")
    if not os.access(cli, os.X_OK):
        pytest.skip("the megamoe command is not built (build/megamoe or MEGAMOE_CLI)")
    ck = tmp_path_factory.mktemp("doc") / "GLM-5"
    subprocess.run([cli, "make-checkpoint", "--preset", "glm-5", "--layers", "1", "--hidden", "256", "--inter",
                    "192", "--experts", "16", "--topk", "4", "--out", str(ck)],
                   check=True, capture_output=True)
    return {"CKPT": str(ck), "CLI": cli}


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _run(cmd, cwd, env, b: Block, code: str):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (
        f"{b.id}: the ```{b.lang} block failed (exit {r.returncode}); as run:\n{code}\n"
        f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}")


@pytest.mark.parametrize("b", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(b: Block, doc_env, tmp_path):
    if b.skip:
        pytest.skip(f"marked not runnable: {b.skip}")
    if b.gpu:
        pytest.skip("marked gpu: needs a CUDA GPU")
    code = b.text()
    env = dict(os.environ, **doc_env)
    if b.lang == "python":
        if "torch" in b.setup + code and not has_torch():
            pytest.skip("uses torch, which is not installed (scripts/test_python_hf.sh runs it)")
        prelude = "import os\nCKPT = os.environ['CKPT']\nCLI = os.environ['CLI']\n"
        script = prelude + b.setup + "\n# ---- the block, as in the docs\n" + code
        (tmp_path / "block.py").write_text(script)
        _run([sys.executable, str(tmp_path / "block.py")], tmp_path, env, b, script)
    elif b.lang == "bash":
        if not (ROOT / "build" / "CMakeCache.txt").is_file():
            # (a GPU machine gets the binaries alone; CI and a checkout have the build tree)
            pytest.skip("no build tree (build/) here: the docs' shell blocks run in one")
        venv_bin = ROOT / "build" / "venv" / "bin"
        env.update(DOC_TMP=str(tmp_path), TMPDIR=str(tmp_path), HOME=str(tmp_path),
                   PATH=f"{venv_bin}:{env['PATH']}" if venv_bin.is_dir() else env["PATH"])
        script = b.setup + "\n" + code
        _run(["bash", "-euo", "pipefail", "-c", script], ROOT, env, b, script)
    elif b.lang == "cpp":
        if b.fragment:
            pytest.skip("marked fragment: part of a program")
        assert re.search(r"\bint\s+main\s*\(", code), (
            f"{b.id}: a ```cpp block that is not a whole program: mark it "
            "<!-- megamoe-doc: fragment --> or make it one")
        cxx = shutil.which(os.environ.get("CXX", "g++"))
        if not cxx:
            pytest.skip("no C++ compiler")
        src = tmp_path / "block.cpp"
        src.write_text(b.setup + "\n" + code)
        _run([cxx, "-std=c++20", "-fsyntax-only", f"-I{ROOT / 'include'}", str(src)], tmp_path, env, b, code)
