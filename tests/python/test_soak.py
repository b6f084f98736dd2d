"""The Python soak (tests/python/soak.py) for a few seconds: on the CPU backend always, on
CUDA where a GPU is. Each run is a subprocess (its own host RSS and fused_moe cache); the
report it writes must show every kind of call made and compared, no mismatch, every
provoked error raised, memory flat. A run with a reference bit flipped on purpose must
fail, and a seed must replay the same steps."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the soak drives MoELayer, ops.fused_moe and the custom op through torch")
import megamoe  # noqa: E402

SOAK = Path(__file__).with_name("soak.py")


def soak(tmp_path, *args, timeout=600):
    out = tmp_path / "soak.json"
    out.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, str(SOAK), *args, "--json", str(out)], capture_output=True, text=True,
                       timeout=timeout)
    assert out.is_file(), f"the soak wrote no report (exit {r.returncode})\n{r.stdout}\n{r.stderr}"
    return r, json.loads(out.read_text())


def assert_clean(r, rep):
    assert r.returncode == 0 and rep["ok"], f"{r.stdout}\n{r.stderr}"
    assert rep["mismatches"] == 0 and rep["unexpected_errors"] == 0 and rep["missing_errors"] == 0
    assert rep["failures"] == []
    for cls, e in rep["errors"].items():
        assert e["raised"] == e["expected"] > 0, cls
    assert set(rep["errors"]) >= {"bad_scale", "bad_scale_beside_valid", "bad_scale_in_session",
                                  "too_many_tokens", "bad_ids"}
    for kind in ("direct", "direct_session", "layerwise", "after_refused"):
        assert rep["reload_kinds"].get(kind, 0) > 0, kind
    f = rep["fused"]
    assert f["layers_freed_with_weights"] > 0 and f["sets_made"] > f["pool"] > f["max_cached"]
    assert rep["compared_rows"] > 0 and rep["routing_checked"] > 0
    mem = rep["memory"]
    assert mem["host_rss_growth"] < mem["host_rss_bound"]
    assert mem["live_layers"][0] == mem["live_layers"][1]
    assert mem["fused_cache"] == [f["max_cached"], f["max_cached"]]


def test_cpu(tmp_path):
    r, rep = soak(tmp_path, "--device", "cpu", "--seconds", "5", "--reloads", "50", "--fused-calls", "200",
                  "--seed", "1")
    assert r.stdout.startswith("soak: seed 1; replay: python tests/python/soak.py ")
    assert_clean(r, rep)
    fw = rep["forwards"]
    for kind in ("eager_own", "eager_external", "counted", "fused_moe", "torch_op"):
        assert fw[kind] > 0, kind
    assert fw["replays"] == 0  # (graphs are CUDA's)
    assert rep["reloads"] >= 50 and fw["fused_moe"] >= 200 and rep["seconds_after_warmup"] >= 5
    assert rep["memory"]["device"] is None


def test_injected_mismatch_fails_and_a_seed_replays(tmp_path):
    args = ["--device", "cpu", "--steps", "60", "--seed", "2"]
    r, clean = soak(tmp_path, *args)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    r, bad = soak(tmp_path, *args, "--inject-mismatch", "45")
    assert r.returncode == 1 and not bad["ok"]
    assert bad["mismatches"] == 1 and len(bad["failures"]) == 1
    step = int(bad["failures"][0].split()[1])
    assert 45 <= step <= 60 and "differ from the reference" in bad["failures"][0]
    # (the flipped bit changes nothing else: the same steps, calls and tokens)
    for key in ("steps", "step_kinds", "tokens", "forwards", "reloads", "reload_kinds", "errors", "fused"):
        assert bad[key] == clean[key], key


@pytest.mark.skipif(not megamoe.cuda_available(), reason="no CUDA backend / no sm_90 GPU here")
def test_cuda(tmp_path):
    r, rep = soak(tmp_path, "--device", "cuda", "--seconds", "20", "--reloads", "100", "--fused-calls", "1000",
                  "--replays", "1000")
    assert_clean(r, rep)
    fw = rep["forwards"]
    for kind in ("eager_own", "eager_external", "replays", "fused_moe", "torch_op"):
        assert fw[kind] > 0, kind
    assert fw["replays"] >= 1000 and fw["counted"] == 0
    d = rep["memory"]["device"]
    assert d["torch_allocated_growth"] == 0 and d["device_other_growth"] <= d["device_other_bound"]


def test_routing_check_tells_a_tie_from_a_wrong_choice():
    """A near tie may swap the last expert (and, normalized, every weight moves with it);
    an expert scored clearly below the reference's choice, or a weight off where the
    experts agree, is a mismatch."""
    import collections
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("megamoe_soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)

    c = torch.tensor([[0.9, 0.8, 0.7, 0.5, 0.5 + 1e-7, 0.1]], dtype=torch.float64)  # selection scores

    class Stub:
        E = 6
        check_routing = mod.Soak.check_routing

        def __init__(self):
            self.stats, self.failures = collections.Counter(), []

        def selection_scores(self, x, router, bias):
            return c

        def fail(self, what):
            self.failures.append(what)

    want_ids, want_w = torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0.9, 0.8, 0.7, 0.5]]) / 2.9
    cases = {  # got ids, got weights -> a mismatch?
        "same": ([0, 1, 2, 3], want_w[0].tolist(), False),
        "tie, weights renormalized": ([0, 1, 2, 4], [0.9 / 3.0, 0.8 / 3.0, 0.7 / 3.0, 0.6 / 3.0], False),
        "a clearly lower expert": ([0, 1, 2, 5], [0.9 / 2.5, 0.8 / 2.5, 0.7 / 2.5, 0.1 / 2.5], True),
        "a top expert dropped for a tie": ([1, 2, 3, 4], [0.8 / 2.5, 0.7 / 2.5, 0.5 / 2.5, 0.5 / 2.5], True),
        "a weight off": ([0, 1, 2, 3], [w + (1e-3 if k == 1 else 0) for k, w in enumerate(want_w[0].tolist())], True),
    }
    for name, (ids, w, bad) in cases.items():
        s = Stub()
        s.check_routing(name, None, torch.tensor([ids]), torch.tensor([w]), want_ids, want_w, None, None)
        assert bool(s.failures) == bad, (name, s.failures)
        assert s.stats["routing_near_ties"] == (name.startswith("tie")), name
