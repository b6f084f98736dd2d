"""bench/python/bench_moe.py on the CPU backend with a tiny shape: the JSON's keys, the
reference check, the PNG, the routing distributions (uniform, zipf, replay), and the
deprecated alias python -m megamoe.bench."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("matplotlib")

import bench_moe as bench  # noqa: E402  (bench/python: conftest puts it on the path)
import megamoe  # noqa: E402
from conftest import ROOT  # noqa: E402

# The folder the tested package was imported from (an install, or build/python-pkg): the
# subprocess must import the same build, not the sources under python/ (no extension there).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megamoe.__file__)))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PACKAGE_ROOT, env.get("PYTHONPATH")] if p)
    return env


def test_cli_smoke_json_and_png(tmp_path):
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "python" / "bench_moe.py"), "--device", "cpu", "--tokens", "4",
         "--routing", "uniform", "zipf:1.5", "--iters", "2", "--warmup", "0", "--json", str(js), "--plot", str(png)],
        capture_output=True, text=True, env=_env(), timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "megamoe us" in r.stdout and "torch us" in r.stdout
    out = json.loads(js.read_text())
    for k in ("commit", "date", "command", "card", "device", "torch", "preset", "shape", "timing", "floors",
              "implementations", "results"):
        assert k in out, k
    assert out["device"] == "cpu" and out["preset"] == "tiny"
    assert "bench/python/bench_moe.py" in out["command"] and "--tokens 4" in out["command"]
    assert out["floors"]["read_bytes_per_s"] > 0 and out["floors"]["tc_flops_per_s"] > 0
    assert out["implementations"]["megamoe"]["available"] and out["implementations"]["torch"]["available"]
    for peer in ("deepgemm", "vllm", "flashinfer"):  # CUDA only: reported, not dropped
        assert out["implementations"][peer]["available"] is False and out["implementations"][peer]["reason"]
    assert [(r["routing"], r["tokens"]) for r in out["results"]] == [("uniform", 4), ("zipf:1.5", 4)]
    for row in out["results"]:
        assert 1 <= row["experts_hit"] <= out["shape"]["experts"]
        assert row["floor_us"] == max(row["read_floor_us"], row["tc_floor_us"]) > 0
        for name in ("megamoe", "torch"):
            r_ = row["impls"][name]
            assert "error" not in r_, r_
            assert r_["median_us"] > 0 and r_["p10_us"] <= r_["median_us"] <= r_["p90_us"]
            assert r_["x_floor"] > 0 and r_["tflops"] > 0
        # megamoe quantizes its activations as the reference does: close; the BF16 torch path
        # does not: the FP8 activation error (a few 1e-2)
        assert row["impls"]["megamoe"]["rel_l2_vs_ref"] < 0.01
        assert row["impls"]["torch"]["rel_l2_vs_ref"] < 0.08
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_deprecated_alias_runs_the_file_from_a_checkout(monkeypatch):
    r = subprocess.run([sys.executable, "-m", "megamoe.bench", "--help"], capture_output=True, text=True,
                       env=_env(), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bench/python/bench_moe.py" in r.stdout  # the file's own usage line
    assert "deprecated" in r.stderr and "bench/python/bench_moe.py" in r.stderr
    monkeypatch.chdir(ROOT)  # (an installed package finds the file from a checkout's root)
    with pytest.warns(DeprecationWarning):
        from megamoe import bench as alias

        assert alias.make_routing is bench.make_routing


def _cfg(**kw):
    import megamoe

    return megamoe.MoEConfig(**{**bench.PRESETS["tiny"], **kw})


def test_routing_distributions(tmp_path):
    import numpy as np

    cfg = _cfg(experts=16, topk=4)
    dev = torch.device("cpu")
    ids, w = bench.make_routing("uniform", 64, cfg, dev, 3)
    assert ids.dtype == torch.int32 and list(ids.shape) == [64, 4] and w.dtype == torch.float32
    assert all(len(set(r)) == 4 for r in ids.tolist())  # K distinct experts a token
    assert torch.allclose(w.sum(1), torch.full((64,), cfg.routed_scaling), rtol=1e-5)
    # Zipf: a hot set. The most popular expert takes far more than 1/E of the slots.
    z, _ = bench.make_routing("zipf:1.5", 512, cfg, dev, 3)
    share = torch.bincount(z.reshape(-1).long(), minlength=16).max().item() / z.numel()
    u = torch.bincount(ids.reshape(-1).long(), minlength=16).max().item() / ids.numel()
    assert share > 2 * u
    assert all(len(set(r)) == 4 for r in z.tolist())
    # replay: rows reused cyclically, weights from the file when it has them
    src = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [15, 14, 13, 12]], dtype=np.int64)
    np.save(tmp_path / "ids.npy", src)
    r, rw = bench.make_routing(f"replay:{tmp_path / 'ids.npy'}", 7, cfg, dev, 3)
    assert r.tolist() == [src[i % 3].tolist() for i in range(7)]
    torch.save({"topk_ids": torch.from_numpy(src), "topk_weights": torch.full((3, 4), 0.25)}, tmp_path / "r.pt")
    r, rw = bench.make_routing(f"replay:{tmp_path / 'r.pt'}", 2, cfg, dev, 3)
    assert r.tolist() == src[:2].tolist() and torch.equal(rw, torch.full((2, 4), 0.25))


@pytest.mark.parametrize(
    "spec, content, match",
    [
        ("zipf:x", None, "zipf:S with a number"),
        ("gauss", None, "uniform, zipf:S or replay:FILE"),
        ("replay:{d}/none.npy", None, "no file"),
        ("replay:{d}/k3.npy", [[0, 1, 2]], r"K = 4"),
        ("replay:{d}/big.npy", [[0, 1, 2, 16]], r"ids in \[0, 16\), found 16"),
    ],
)
def test_routing_errors(tmp_path, spec, content, match):
    import numpy as np

    spec = spec.format(d=tmp_path)
    if content is not None:
        np.save(spec.split(":", 1)[1], np.array(content, dtype=np.int64))
    with pytest.raises(ValueError, match=match):
        bench.make_routing(spec, 4, _cfg(experts=16, topk=4), torch.device("cpu"), 0)


def test_quant_1x128_matches_spec():
    """s = max(amax, 1e-4) / 448 per 128 columns, q = e4m3(x * (1/s)); a partial last block."""
    x = torch.randn(3, 300) * 5
    x[1, :128] = 0  # an all-zero block: the 1e-4 floor
    q, s = bench.quant_1x128(x)
    assert list(q.shape) == [3, 300] and list(s.shape) == [3, 3]
    for r in range(3):
        for b in range(3):
            blk = x[r, b * 128:(b + 1) * 128]
            want = max(float(blk.abs().max()), 1e-4) / 448.0
            assert s[r, b].item() == pytest.approx(want, rel=1e-6)
    back = bench.dequant_rows(q, s)
    assert bench.rel_l2(back, x) < 0.05 and bool(torch.isfinite(back).all())
