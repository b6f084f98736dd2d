"""Fixtures of the Python tests: the `megamoe` command (for checkpoints and the CLI's
output to compare against), a small synthetic checkpoint, its raw tensors, random
inputs. The independent float64 implementation is tests/tools/moe_float64.py."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "tools"))
# The benchmarks (bench_moe, bench_host_overhead): in the repository, not in the package.
sys.path.insert(0, str(ROOT / "bench" / "python"))
import moe_float64 as f64  # noqa: E402

LAYER = 3  # the synthetic glm-5.3-flash checkpoint's MoE layer
P = f"model.language_model.layers.{LAYER}.mlp."  # its tensors' prefix (multimodal GLM-5.3-Flash)


def find_cli():
    env = os.environ.get("MEGAMOE_CLI")
    if env:
        return env
    for d in ("build", "build-cpu", "build-py"):
        p = ROOT / d / "megamoe"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("megamoe")


@pytest.fixture(scope="session")
def cli():
    c = find_cli()
    if not c:
        pytest.skip("the megamoe command is not built (set MEGAMOE_CLI or build build/megamoe)")
    return c


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="session")
def ckpt(cli, tmp_path_factory):
    """A glm-5.3-flash-shaped checkpoint (sigmoid routing, F32 router, a shared expert,
    a SwiGLU clamp, non-power-of-two scales, I not a multiple of 128)."""
    d = tmp_path_factory.mktemp("ckpt") / "ck"
    run([cli, "make-checkpoint", "--preset", "glm-5.3-flash", "--layers", "1", "--hidden", "256",
         "--inter", "192", "--experts", "16", "--topk", "4", "--out", str(d)])
    return str(d)


@pytest.fixture(scope="session")
def ckpt_tensors(ckpt):
    """Every tensor of the MoE layer as raw numpy arrays (F8 as uint8 codes, BF16 as
    uint16 bits), by full name."""
    ck = f64.Checkpoint(ckpt)
    out = {}
    for name in ck.weight_map:
        if f".layers.{LAYER}.mlp." in name and (".experts." in name or ".gate." in name or "shared_experts" in name):
            st = ck._file(os.path.join(ckpt, ck.weight_map[name]))
            dt, a = st.raw(name)
            out[name] = (dt, np.array(a))
    return out


def bf16(a):
    """float64/32 values -> an ml_dtypes bfloat16 array (round to nearest even)."""
    import ml_dtypes

    return f64.f64_to_bf16_bits(a).view(ml_dtypes.bfloat16)


def bits(a):
    """The raw bytes of an array (bfloat16 arrays compare bit for bit)."""
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


@pytest.fixture
def x16():
    """Fresh random tokens, BF16 [24, 256] (never zeros)."""
    rng = np.random.default_rng()
    return bf16(rng.standard_normal((24, 256)))
