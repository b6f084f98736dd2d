#!/usr/bin/env python3
"""The Python soak: a randomized differential run of megamoe's Python entry points under an
engine's traffic, against the kernel-faithful CPU reference, byte for byte.

`megamoe soak` (the C++ command) holds the library's layer objects to the reference; this
run holds what Python callers use to the same standard, where the Python layer adds code of
its own: `MoELayer` (eager forwards, CUDA graph replays with the token count in device
memory, in-place reloads through `load_weights` and `reloading()`), `megamoe.ops.fused_moe`
(its cache of borrowed layers, keyed by weight pointers, freed with the weight tensors and
capped at `megamoe.ops.MAX_CACHED`) and the custom op `torch.ops.megamoe.moe_forward`.

Step after step it draws one of:

- eager forwards of 0..max_tokens tokens (0, 1 and max_tokens included) on the layer's own
  routing and on external routing (uniform, zipf-skewed, one expert in every token, every
  expert once; int32 and int64 ids; a few rows of extreme finite values), with and without
  `out=` and a host token count;
- replays: on CUDA, graphs captured once at max_tokens (own routing, external int32 and
  int64 ids) replayed with the count changed in device memory before each replay, and now
  and then the same call made eagerly with the device count; on the CPU, the same buffers
  run with a host count. Each replay's rows are a fresh permutation of
  a block of tokens whose reference is computed once per weight version (a token's output
  depends only on its own row), which keeps a replay cheap;
- reloads into NEW tensors each time (`megamoe.quantize_block_fp8`): direct calls of a few
  weight/scale pairs, the router or the bias; direct sessions with the weight and its scale
  in separate calls; layerwise sessions bringing the whole layer in shuffled order;
- refused calls, which must raise and leave the weights as they were: a NaN, infinite or
  negative block scale (alone, beside a valid pair, inside a session that then completes),
  more than max_tokens tokens, an expert id outside [0, E);
- `megamoe.ops.fused_moe` calls over a pool of weight sets (more sets than MAX_CACHED) in
  which a set is replaced by newly allocated tensors every few calls: the borrowed layer of
  a dropped set must be freed at once, the cache must stay within MAX_CACHED;
- `torch.ops.megamoe.moe_forward` / `moe_forward_out`, with and without a token count.

The reference is a CPU `MoELayer` built from the same stacked weights and reloaded with the
same calls (each fused weight set has its own). The CUDA layer is bit-identical to it
(docs/numerics.md §10): outputs compare as BF16 bit patterns, NaN payloads aside; the
layer's own routing must match the reference's ids except where selection scores tie to
within 1e-5, and its weights within 1e-5 (CUDA; the CPU backend matches exactly), and the
output is compared with the reference run on the routing the layer used. With --device cpu
the layer under test is a second CPU layer: the Python plumbing, reloads, the op cache and
host memory are what is checked there.

Memory: after a warm-up (every step kind, every power-of-two token count, the fused cache
filled), the run records host RSS and, on CUDA, torch's allocated bytes and the device
memory outside torch's caching allocator; at the end torch's allocated bytes must not have
grown at all, the device memory outside torch by no more than 2 MiB (lazily loaded kernels),
and host RSS by less than 8 MiB (Python's and glibc's allocators keep freed memory in
pools; the C++ soak holds its own RSS to 1 MB).

    python tests/python/soak.py --device cpu|cuda --seconds S [--seed N] [--json PATH]
        [--reloads N] [--fused-calls N] [--replays N] [--steps N] [--max-tokens M]
        [--preset P] [--hidden H --inter I --experts E --topk K]

The run lasts --seconds and until it has made --reloads reloads, --fused-calls fused_moe
calls and --replays replays. Its first line prints the seed and the command that replays
it: the steps depend on the seed only, so a failure at step N replays with --seed S
--steps N. Exit status 1 on any mismatch, unexpected or missing error, or memory growth.
This is test code: nothing here is part of the package.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import random
import shlex
import sys
import time
import weakref

import torch

import megamoe
from megamoe import _layer as megamoe_layer  # the registry of live layers (counted at the checkpoints)

MiB = 1 << 20
HOST_RSS_BOUND = 8 * MiB
DEVICE_OTHER_BOUND = 2 * MiB
POISON = -1  # int16 0xFFFF: a BF16 NaN, what an output holds before the layer writes it
MAX_FAILURES_SHOWN = 20
MAX_UNEXPECTED = 50
MAX_FINITE_BF16 = 3.3895313892515355e38


# ---------------------------------------------------------------- options


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=0,
                    help="stop after step N, the warm-up's included (0: run for --seconds and the targets)")
    ap.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--reloads", type=int, default=50, help="run until at least this many reloads")
    ap.add_argument("--fused-calls", type=int, default=200, help="run until at least this many fused_moe calls")
    ap.add_argument("--replays", type=int, default=0, help="run until at least this many replays")
    ap.add_argument("--max-tokens", type=int, default=0, help="default: 16 on the CPU, 256 on CUDA")
    ap.add_argument("--fused-pool", type=int, default=0,
                    help="weight sets fused_moe cycles through (default: megamoe.ops.MAX_CACHED + 8)")
    ap.add_argument("--preset", default="glm-5.3-flash", choices=sorted(megamoe.MoEConfig.presets()))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    # The check of the checker: one reference bit flipped at the first comparison from this step on.
    ap.add_argument("--inject-mismatch", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 2**31)
    if a.max_tokens <= 0:
        a.max_tokens = 256 if a.device == "cuda" else 16
    if a.fused_pool <= 0:
        a.fused_pool = megamoe.ops.MAX_CACHED + 8
    return a


def replay_command(argv, seed):
    """The command line that replays this run: the same options with --seed fixed."""
    out, skip = [], False
    for w in argv:
        if skip:
            skip = False
        elif w == "--seed":
            skip = True
        elif not w.startswith("--seed="):
            out.append(w)
    return shlex.join(["python", "tests/python/soak.py", *out, "--seed", str(seed)])


# ---------------------------------------------------------------- memory


def host_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim():
    # Returns glibc's freed heap pages to the system, so RSS measures live memory, not the
    # allocator's retained pool.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# ---------------------------------------------------------------- the run


@dataclasses.dataclass
class Epoch:
    """A block of max_tokens tokens and its reference output under the current weights:
    the rows replays draw from."""

    version: int
    x_dev: torch.Tensor
    y_ref: torch.Tensor  # host
    y_ref_dev: torch.Tensor
    ids_dev: torch.Tensor = None  # external routing (the replay's dtype), or the layer's own routing
    w_dev: torch.Tensor = None


def gather(t, idx):
    """t[idx] as a new tensor; float8 through its uint8 codes (indexing kernels need not
    cover float8)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)[idx].view(t.dtype)
    return t[idx]


class FusedSet:
    """One set of stacked weights for fused_moe: device tensors, newly allocated, and the
    host tensors with the same bytes (the reference's)."""

    serial = 0

    def __init__(self, tensors, host):
        FusedSet.serial += 1
        self.id = FusedSet.serial
        self.t = tensors
        self.host = host
        self.layers = []  # weak references to the cached layers built for it


class Soak:
    def __init__(self, a, argv):
        self.a = a
        self.argv = argv  # (the replay command in the report)
        self.rng = random.Random(a.seed)
        self.gen = torch.Generator().manual_seed(a.seed)
        self.cuda = a.device == "cuda"
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        base = megamoe.MoEConfig.presets()[a.preset]
        self.cfg = dataclasses.replace(base, hidden=a.hidden, inter=a.inter, experts=a.experts, topk=a.topk)
        self.cfg.validate()
        c = self.cfg
        self.E, self.H, self.I, self.K, self.M = c.experts, c.hidden, c.inter, c.topk, a.max_tokens
        self.SI = c.inter * c.shared_experts
        self.router_dtype = torch.float32 if c.router_dtype == "f32" else torch.bfloat16
        self.stats = collections.Counter()
        self.kinds = collections.Counter()
        self.errors = collections.defaultdict(lambda: {"expected": 0, "raised": 0})
        self.failures = []
        self.step_no = 0
        self.step_kind = "setup"
        self.injected = False
        self.version = 0  # of the layer's weights; replays' epochs follow it
        self.epochs = {}

        named = self.layer_tensors()
        self.router_host = named["gate.weight"].clone()
        self.bias_host = named.get("gate.e_score_correction_bias")
        stacked = self.stack(named)
        self.ref = megamoe.MoELayer.from_stacked(c, **stacked, device="cpu", max_tokens=self.M)
        dev_stacked = {k: v.to(self.dev) for k, v in stacked.items()}
        self.dut = megamoe.MoELayer.from_stacked(c, **dev_stacked, device=a.device, max_tokens=self.M)
        del dev_stacked, stacked, named
        self.address = self.dut.weights_address

        # Replays: one set of buffers; on CUDA, graphs captured at max_tokens.
        M, H, K = self.M, self.H, self.K
        self.x_buf = torch.zeros(M, H, dtype=torch.bfloat16, device=self.dev)
        self.y_buf = torch.zeros(M, H, dtype=torch.bfloat16, device=self.dev)
        self.ids_buf = {torch.int32: torch.zeros(M, K, dtype=torch.int32, device=self.dev),
                        torch.int64: torch.zeros(M, K, dtype=torch.int64, device=self.dev)}
        self.w_buf = torch.full((M, K), 0.5, dtype=torch.float32, device=self.dev)
        for i in range(K):
            for ids in self.ids_buf.values():
                ids[:, i] = i
        self.graphs = {}
        if self.cuda:
            self.count = torch.tensor([M], dtype=torch.int32, device=self.dev)
            self.capture_graphs()

        # fused_moe: banks of quantized experts the weight sets are drawn from.
        E, I, SI = self.E, self.I, self.SI
        B = 2 * E
        self.bank = {
            "w13": self.expert_stack(B, 2 * I, H, halves=True),
            "w2": self.expert_stack(B, H, I),
        }
        if SI:
            self.bank["shared_w13"] = self.expert_stack(2, 2 * SI, H, halves=True)
            self.bank["shared_w2"] = self.expert_stack(2, H, SI)
        self.bank_router = (torch.randn(B, H, generator=self.gen) * 0.05).to(self.router_dtype)
        self.bank_dev = {k: (w.to(self.dev), s.to(self.dev)) for k, (w, s) in self.bank.items()}
        self.bank_router_dev = self.bank_router.to(self.dev)
        self.pool = [None] * a.fused_pool
        self.newest = 0
        self.fused_refs = collections.OrderedDict()  # FusedSet.id -> its CPU reference layer (a few)

    # ---------------------------------------------------------------- weights

    def quantized(self, rows, cols):
        amp = 0.02 + 0.08 * self.rng.random()
        return megamoe.quantize_block_fp8(torch.randn(rows, cols, generator=self.gen) * amp)

    def projections(self):
        """(relative name, rows, cols) of every block-FP8 weight of the layer."""
        H, I, SI = self.H, self.I, self.SI
        out = []
        for e in range(self.E):
            out += [(f"experts.{e}.gate_proj", I, H), (f"experts.{e}.up_proj", I, H), (f"experts.{e}.down_proj", H, I)]
        if SI:
            out += [("shared_experts.gate_proj", SI, H), ("shared_experts.up_proj", SI, H),
                    ("shared_experts.down_proj", H, SI)]
        return out

    def new_router(self):
        return (torch.randn(self.E, self.H, generator=self.gen) * 0.05).to(self.router_dtype)

    def new_bias(self):
        return torch.randn(self.E, generator=self.gen) * 0.01

    def layer_tensors(self):
        """Every tensor of the layer, new, by relative checkpoint name (host tensors)."""
        t = {}
        for name, rows, cols in self.projections():
            t[name + ".weight"], t[name + ".weight_scale_inv"] = self.quantized(rows, cols)
        t["gate.weight"] = self.new_router()
        if self.cfg.correction_bias:
            t["gate.e_score_correction_bias"] = self.new_bias()
        return t

    def stack(self, t):
        """Checkpoint tensors -> from_stacked's keyword arguments (the kernel layout)."""
        def pair(p):
            return t[p + ".weight"], t[p + ".weight_scale_inv"]

        def w13(prefix):
            (g, gs), (u, us) = pair(prefix + "gate_proj"), pair(prefix + "up_proj")
            return torch.cat([g, u]), torch.cat([gs, us])

        e13 = [w13(f"experts.{e}.") for e in range(self.E)]
        e2 = [pair(f"experts.{e}.down_proj") for e in range(self.E)]
        out = dict(w13=torch.stack([w for w, _ in e13]), w13_scale=torch.stack([s for _, s in e13]),
                   w2=torch.stack([w for w, _ in e2]), w2_scale=torch.stack([s for _, s in e2]),
                   router=t["gate.weight"])
        if self.cfg.correction_bias:
            out["bias"] = t["gate.e_score_correction_bias"]
        if self.SI:
            out["shared_w13"], out["shared_w13_scale"] = w13("shared_experts.")
            out["shared_w2"], out["shared_w2_scale"] = pair("shared_experts.down_proj")
        return out

    def expert_stack(self, n, rows, cols, halves=False):
        """n experts' block-FP8 weights [n, rows, cols] and scales; halves: gate and up
        quantized apart (their blocks do not straddle the boundary)."""
        ws, ss = [], []
        for _ in range(n):
            if halves:
                (g, gs), (u, us) = self.quantized(rows // 2, cols), self.quantized(rows // 2, cols)
                w, s = torch.cat([g, u]), torch.cat([gs, us])
            else:
                w, s = self.quantized(rows, cols)
            ws.append(w)
            ss.append(s)
        return torch.stack(ws), torch.stack(ss)

    # ---------------------------------------------------------------- inputs

    def draw_tokens(self, hi):
        r = self.rng.random()
        if r < 0.05 or hi == 0:
            return 0
        if r < 0.15 or hi == 1:
            return 1
        if r < 0.25:
            return hi
        return min(hi, max(2, round(math.exp(self.rng.uniform(math.log(2), math.log(hi))))))

    def draw_x(self, T, extremes=False):
        scale = 10 ** self.rng.uniform(-2, 1)
        x = (torch.randn(T, self.H, generator=self.gen) * scale).to(torch.bfloat16)
        if extremes and T:
            for _ in range(self.rng.randint(1, 2)):
                t = self.rng.randrange(T)
                cols = torch.randperm(self.H, generator=self.gen)[: self.rng.randint(1, 8)]
                if self.rng.random() < 0.5:
                    x[t, cols] = MAX_FINITE_BF16 * self.rng.choice([-1.0, 1.0])
                else:
                    x[t] = (torch.randn(self.H, generator=self.gen) * 1e-39).to(torch.bfloat16)  # subnormals
        return x

    def draw_routing(self, T, dist):
        """External routing of T tokens: K distinct experts a token, weights in [0.05, 1.5)."""
        E, K = self.E, self.K
        perm = torch.randperm(E, generator=self.gen)
        if dist == "every":
            ids = perm[torch.arange(T * K) % E].view(T, K)
        else:
            if dist == "zipf":
                z = 0.5 + 1.5 * self.rng.random()
                logp = torch.empty(E)
                logp[perm] = -z * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
            else:
                logp = torch.zeros(E)
            if dist == "one":
                logp[perm[0]] = -math.inf  # placed below, in a random slot
            # K distinct draws without replacement, by the Gumbel top-k of the log-weights.
            u = torch.rand(T, E, generator=self.gen).clamp_min(1e-12)
            keys = logp - torch.log(-torch.log(u))
            ids = keys.topk(K - (dist == "one"), dim=1).indices
            if dist == "one":
                hot = torch.full((T, 1), int(perm[0]))
                ids = torch.cat([hot, ids], dim=1)
                swap = torch.randint(0, K, (T,), generator=self.gen)
                rows = torch.arange(T)
                first = ids[:, 0].clone()
                ids[:, 0] = ids[rows, swap]
                ids[rows, swap] = first
        w = 0.05 + 1.45 * torch.rand(T, K, generator=self.gen)
        return ids.to(torch.int64).contiguous(), w.contiguous()

    def every_expert_tokens(self):
        return -(-self.E // self.K)

    # ---------------------------------------------------------------- checks

    def note(self, what):
        line = f"step {self.step_no} ({self.step_kind}): {what}"
        if len(self.failures) < MAX_FAILURES_SHOWN:
            self.failures.append(line)
            print(f"soak: FAIL {line}", file=sys.stderr, flush=True)

    def fail(self, what):
        self.stats["mismatches"] += 1
        self.note(what)

    def inject_pending(self):
        return self.a.inject_mismatch > 0 and not self.injected and self.step_no >= self.a.inject_mismatch

    def compare(self, what, got, want):
        """got, want: BF16 [n, H] (got on any device); equal bit for bit, NaN payloads aside."""
        got = got.cpu()
        n = want.shape[0]
        if got.shape != want.shape:
            self.fail(f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
            return
        self.stats["compared_rows"] += n
        if n == 0:
            return
        if self.inject_pending():
            want = want.clone()
            flat = want.view(torch.int16).view(-1)
            i = int(torch.nonzero(~want.view(-1).isnan())[0]) if not bool(want.isnan().all()) else 0
            flat[i] ^= 1 if not bool(want.view(-1)[i].isnan()) else 1 << 14
            self.injected = True
        g, w = got.view(torch.int16), want.view(torch.int16)
        same = (g == w) | (got.isnan() & want.isnan())
        if bool(same.all()):
            return
        bad = (~same).any(dim=1).nonzero().view(-1)
        r = int(bad[0])
        col = int((~same[r]).nonzero()[0])
        self.fail(f"{what}: {len(bad)} of {n} rows differ from the reference (first: row {r} column {col}, "
                  f"{int(g[r, col]) & 0xFFFF:#06x} vs {int(w[r, col]) & 0xFFFF:#06x})")

    def selection_scores(self, x, router, bias):
        """The routing's selection scores c [T, E] in float64 (docs/numerics.md §6): only for
        telling a near tie from a wrong choice."""
        c = self.cfg
        z = (x.double() @ router.double().t()).float().double()
        if c.score == "sigmoid":
            s = torch.sigmoid(z)
        elif c.score == "softmax":
            s = torch.softmax(z, dim=1)
        else:
            s = torch.sqrt(torch.nn.functional.softplus(z))
        sel = s + (bias.double() if bias is not None else 0.0)
        if c.n_group > 1:
            g = sel.view(sel.shape[0], c.n_group, -1)
            gs = g.topk(2, dim=2).values.sum(2)
            keep = gs.topk(c.topk_group, dim=1).indices
            mask = torch.ones_like(gs, dtype=torch.bool)
            mask.scatter_(1, keep, False)
            sel = g.masked_fill(mask[:, :, None], -math.inf).view(sel.shape[0], -1)
        return sel

    def check_routing(self, what, x, got_ids, got_w, want_ids, want_w, router, bias):
        """The layer's own routing against the reference's, by tools/soak_routing.h's rule: the
        same experts except where their selection scores tie to within 1e-5 (both ways: an
        expert only the layer picked scores as the reference's last pick, and one only the
        reference picked as the layer's last), and where they agree weights within 1e-5."""
        c = None

        def near(v, m):
            return abs(v - m) <= 1e-5 * max(1.0, abs(m))

        def ties_last(t, extra, picks):
            """Each expert of `extra` that `picks` lacks is a real expert scoring as picks' last."""
            m = min(float(c[t, j]) for j in picks)
            return all(0 <= e < self.E and near(float(c[t, e]), m) for e in extra if e not in picks)

        for t in range(got_ids.shape[0]):
            gi, wi = got_ids[t].tolist(), want_ids[t].tolist()
            tie = any(e not in wi for e in gi)
            bad = False
            if tie:
                if c is None:
                    c = self.selection_scores(x, router, bias)
                # (the layer's ids first: an id out of range fails there, before it indexes c)
                bad = not (ties_last(t, gi, wi) and ties_last(t, wi, gi))
            # The weights where the experts agree: after a tie swapped one, the normalized
            # weights of the others differ too (their sum holds the swapped expert's score).
            if not tie:  # (near() is False for a NaN weight)
                bad = not all(near(float(got_w[t, k]), float(want_w[t, wi.index(e)])) for k, e in enumerate(gi))
            if bad:
                self.fail(f"{what}: token {t}'s routing differs from the reference beyond ties: ids {gi} "
                          f"weights {got_w[t].tolist()} vs {wi} {want_w[t].tolist()}")
                return
            if tie:
                self.stats["routing_near_ties"] += 1
        self.stats["routing_checked"] += got_ids.shape[0]

    def expect_own(self, what, ref, x, got_ids, got_w, router, bias):
        """The reference output for a forward on the layer's own routing, which came back as
        got_ids / got_w: the reference's own forward where they agree bit for bit, else the
        reference run on the layer's routing once that routing is checked."""
        y = ref(x)
        want_ids, want_w = ref.topk_ids.clone(), ref.topk_weights.clone()
        got_ids, got_w = got_ids.cpu(), got_w.cpu()
        if torch.equal(got_ids, want_ids) and torch.equal(got_w.view(torch.int32), want_w.view(torch.int32)):
            self.stats["routing_checked"] += got_ids.shape[0]
            return y
        if not self.cuda:  # two CPU layers: the same routing, exactly
            self.fail(f"{what}: the CPU layer's own routing differs from the reference's")
            return y
        self.check_routing(what, x, got_ids, got_w, want_ids, want_w, router, bias)
        return ref(x, got_ids, got_w)

    def expect_error(self, cls, exc_type, f):
        """f() must raise exc_type; counted under cls."""
        self.errors[cls]["expected"] += 1
        try:
            f()
        except exc_type:
            self.errors[cls]["raised"] += 1
            return True
        except Exception as e:  # the wrong error
            self.stats["unexpected_errors"] += 1
            self.note(f"{cls}: expected {exc_type.__name__}, got {type(e).__name__}: {e}")
            return False
        self.stats["missing_errors"] += 1
        self.note(f"{cls}: expected {exc_type.__name__}, nothing was raised")
        return False

    # ---------------------------------------------------------------- eager forwards

    def step_eager(self, T=None, ext=None, dist=None, id_dtype=None, mode=None):
        rng = self.rng
        ext = rng.random() < 0.5 if ext is None else ext
        dist = dist or rng.choice(["uniform", "zipf", "one", "every"])
        if T is None:
            T = self.every_expert_tokens() if ext and dist == "every" else self.draw_tokens(self.M)
        T = min(T, self.M)
        extremes = ext and rng.random() < 0.1
        x = self.draw_x(T, extremes)
        mode = mode or rng.choice(["plain", "out", "count"])
        ids = w = ids_d = w_d = None
        if ext:
            ids, w = self.draw_routing(T, dist)
            id_dtype = id_dtype or rng.choice([torch.int32, torch.int64])
            ids = ids.to(id_dtype)
            ids_d, w_d = ids.to(self.dev), w.to(self.dev)
        x_d = x.to(self.dev)
        n = T
        if mode == "plain":
            y = self.dut(x_d, ids_d, w_d)
        else:
            y = torch.empty_like(x_d)
            y.view(torch.int16).fill_(POISON)
            if mode == "count":
                n = rng.randint(0, T) if T else 0
                self.dut(x_d, ids_d, w_d, out=y, num_tokens=n)
                rest = y[n:].cpu().view(torch.int16)
                if not bool((rest == POISON).all()):
                    self.fail(f"eager forward of {n} of {T} rows (host count) wrote rows past the count")
            else:
                self.dut(x_d, ids_d, w_d, out=y)
        self.stats["forwards_eager_external" if ext else "forwards_eager_own"] += 1
        self.stats["tokens"] += n
        routing = f"external {dist} {str(id_dtype).replace('torch.', '')}" if ext else "own"
        self.check_dut(f"eager forward ({mode}), {n} of {T} tokens, {routing} routing", y, x, n, ids, w)

    def check_dut(self, what, y, x, n, ids=None, w=None):
        """The first n rows of a forward of the layer under test against the reference: on the
        caller's routing (ids, w) or, with ids None, on the layer's own (as it came back)."""
        if ids is not None:
            want = self.ref(x[:n], ids[:n], w[:n])
        else:
            want = self.expect_own(what, self.ref, x[:n], self.dut.topk_ids[:n], self.dut.topk_weights[:n],
                                   self.router_host, self.bias_host)
        self.compare(what, y[:n], want)

    # ---------------------------------------------------------------- replays

    def capture_graphs(self):
        count, x, y = self.count, self.x_buf, self.y_buf
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the capture
            self.dut(x, out=y, num_tokens=count)
            for dt in (torch.int32, torch.int64):
                self.dut(x, self.ids_buf[dt], self.w_buf, out=y, num_tokens=count)
        torch.cuda.current_stream().wait_stream(s)
        for kind, dt in (("own", None), ("ext32", torch.int32), ("ext64", torch.int64)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                if dt is None:
                    self.dut(x, out=y, num_tokens=count)
                else:
                    self.dut(x, self.ids_buf[dt], self.w_buf, out=y, num_tokens=count)
            self.graphs[kind] = g
        torch.cuda.synchronize()
        self.dut.check()

    def run_buffers(self, kind, n, eager=False):
        """One forward of the first n rows of the buffers: on CUDA with the count set in
        device memory, a graph replay or (eager) the same call made directly; on the CPU,
        the buffers with a host count."""
        if self.cuda:
            self.count.fill_(n)
            if not eager:
                self.graphs[kind].replay()
                self.stats["replays"] += 1
                return
            args = () if kind == "own" else (self.ids_buf[self.id_dtype(kind)], self.w_buf)
            self.dut(self.x_buf, *args, out=self.y_buf, num_tokens=self.count)
            self.stats["forwards_eager_device_count"] += 1
            return
        args = () if kind == "own" else (self.ids_buf[self.id_dtype(kind)], self.w_buf)
        self.dut(self.x_buf, *args, out=self.y_buf, num_tokens=n)
        self.stats["forwards_counted"] += 1

    @staticmethod
    def id_dtype(kind):
        return {"own": None, "ext32": torch.int32, "ext64": torch.int64}[kind]

    def epoch(self, kind):
        """The block of tokens replays of `kind` draw rows from, and its reference under the
        current weights (made again after every reload)."""
        ep = self.epochs.get(kind)
        if ep is not None and ep.version == self.version:
            return ep
        self.epochs.pop(kind, None)
        M = self.M
        x = self.draw_x(M)
        x_dev = x.to(self.dev)
        self.x_buf.copy_(x_dev)
        if kind == "own":
            self.y_buf.view(torch.int16).fill_(POISON)
            self.run_buffers(kind, M, eager=True)
            self.stats["tokens"] += M
            ids_dev = self.dut.topk_ids[:M].clone()
            w_dev = self.dut.topk_weights[:M].clone()
            y_ref = self.expect_own(f"replay epoch ({kind}), {M} tokens", self.ref, x, ids_dev, w_dev,
                                    self.router_host, self.bias_host)
            self.compare(f"replay epoch ({kind}), {M} tokens", self.y_buf, y_ref)
        else:
            ids, w = self.draw_routing(M, self.rng.choice(["uniform", "zipf", "one"]))
            ids = ids.to(self.id_dtype(kind))
            ids_dev, w_dev = ids.to(self.dev), w.to(self.dev)
            y_ref = self.ref(x, ids, w)
        ep = Epoch(self.version, x_dev, y_ref, y_ref.to(self.dev), ids_dev, w_dev)
        self.epochs[kind] = ep
        return ep

    def step_replays(self, kind=None, counts=None):
        kind = kind or self.rng.choice(["own", "ext32", "ext64"])
        ep = self.epoch(kind)
        M, dt = self.M, self.id_dtype(kind)
        if counts is None:
            counts = [self.draw_tokens(M) for _ in range(self.rng.randint(1, 32))]
        for i, n in enumerate(counts):
            # The first forward of an own-routing step is the eager call: a replay leaves
            # layer.topk_ids with the row count of the last eager call, which the eager call
            # with the device count makes max_tokens for the replays that follow.
            eager = kind == "own" and i == 0 or self.rng.random() < 0.1
            perm = torch.randperm(M, generator=self.gen)[:n].to(self.dev)
            torch.index_select(ep.x_dev, 0, perm, out=self.x_buf[:n])
            if dt is not None:
                torch.index_select(ep.ids_dev, 0, perm, out=self.ids_buf[dt][:n])
                torch.index_select(ep.w_dev, 0, perm, out=self.w_buf[:n])
            self.y_buf.view(torch.int16).fill_(POISON)
            self.run_buffers(kind, n, eager)
            self.stats["tokens"] += n
            self.stats["compared_rows"] += n
            want = ep.y_ref_dev.index_select(0, perm)
            ok = torch.equal(self.y_buf[:n].view(torch.int16), want.view(torch.int16))
            ok = ok and bool((self.y_buf[n:].view(torch.int16) == POISON).all())
            if kind == "own" and n:
                ok = ok and torch.equal(self.dut.topk_ids[:n], ep.ids_dev.index_select(0, perm))
                ok = ok and torch.equal(self.dut.topk_weights[:n].view(torch.int32),
                                        ep.w_dev.index_select(0, perm).view(torch.int32))
            if ok and not self.inject_pending():
                continue
            # (the detailed comparison, on the host: NaN payloads aside, which rows, which routing)
            self.stats["compared_rows"] -= n
            how = "counted forward" if not self.cuda else "eager device-count forward" if eager else "replay"
            what = f"{how} ({kind}) of {n} of {M} rows"
            self.compare(what, self.y_buf[:n], ep.y_ref.index_select(0, perm.cpu()))
            if not bool((self.y_buf[n:].view(torch.int16) == POISON).all()):
                self.fail(f"{what}: rows past the count were written")
            if kind == "own" and n and not torch.equal(self.dut.topk_ids[:n], ep.ids_dev.index_select(0, perm)):
                self.fail(f"{what}: the layer's routing of a token changed with the batch")
        if self.cuda:
            self.dut.check()

    # ---------------------------------------------------------------- reloads

    def names(self, base):
        return self.rng.choice(["mlp.", ""]) + base

    def apply(self, calls, session):
        """The same load_weights calls on the layer under test (each tensor on its device or
        the host, at random) and on the reference (host tensors). session: None (each call
        its own session, direct), "direct" or "layerwise"."""
        styles = [self.rng.choice(["pairs", "dict", "name"]) for _ in calls]
        for layer in (self.dut, self.ref):
            with layer.reloading(mode=session) if session else contextlib.nullcontext():
                for call, style in zip(calls, styles):
                    self.load(layer, call, style)
        self.version += 1
        self.stats["reload_tensors"] += sum(len(c) for c in calls)
        if self.dut.weights_address != self.address:
            self.fail(f"the layer's weights moved: {self.address:#x} -> {self.dut.weights_address:#x}")
            self.address = self.dut.weights_address

    def load(self, layer, call, style="pairs"):
        """One load_weights call: (name, tensor) pairs, a dict, or a name and its tensor (a
        call of one tensor). The layer under test takes device tensors half the time (CUDA)."""
        if layer is self.dut and self.cuda:
            call = [(n, t.to(self.dev) if self.rng.random() < 0.5 else t) for n, t in call]
        else:
            call = [(n, t.cpu()) for n, t in call]
        if style == "name" and len(call) == 1:
            return layer.load_weights(call[0][0], call[0][1])
        return layer.load_weights(dict(call) if style == "dict" else call)

    def new_pair(self, base, rows, cols):
        w, s = self.quantized(rows, cols)
        name = self.names(base)
        return [(name + ".weight", w), (name + ".weight_scale_inv", s)]

    def new_items(self, count):
        """Up to count distinct reloadable items, new tensors: a weight with its scale, the
        router, the bias."""
        projections = self.projections()
        items, taken = [], set()
        for _ in range(count):
            r = self.rng.random()
            if r < 0.1:
                what = "gate.weight"
            elif r < 0.2 and self.cfg.correction_bias:
                what = "gate.e_score_correction_bias"
            else:
                what = self.rng.choice(projections)
            key = what if isinstance(what, str) else what[0]
            if key in taken:
                continue
            taken.add(key)
            if what == "gate.weight":
                items.append([(self.names(what), self.new_router())])
            elif what == "gate.e_score_correction_bias":
                items.append([(self.names(what), self.new_bias())])
            else:
                items.append(self.new_pair(*what))
        return items

    def track_router(self, calls):
        for call in calls:
            for name, t in call:
                if name.endswith("gate.weight"):
                    self.router_host = t.clone()
                elif name.endswith("e_score_correction_bias"):
                    self.bias_host = t.clone()

    def step_reload(self, kind=None):
        kind = kind or self.rng.choices(["direct", "direct_session", "layerwise"], [6, 2, 2])[0]
        if kind == "direct":
            # One call: a few items, each pair whole.
            calls = [[p for item in self.new_items(self.rng.randint(1, 4)) for p in item]]
            session = None
        elif kind == "direct_session":
            # A session: the tensors of a few items in separate calls, shuffled.
            tensors = [p for item in self.new_items(self.rng.randint(1, 4)) for p in item]
            self.rng.shuffle(tensors)
            calls = [[t] for t in tensors]
            session = "direct"
        else:
            # The whole layer, new tensors, in shuffled calls of one to four tensors.
            tensors = [(self.names(n), t) for n, t in self.layer_tensors().items()]
            self.rng.shuffle(tensors)
            calls = []
            while tensors:
                k = self.rng.randint(1, 4)
                calls.append(tensors[:k])
                tensors = tensors[k:]
            session = "layerwise"
        self.apply(calls, session)
        self.track_router(calls)
        self.stats["reloads"] += 1
        self.stats[f"reloads_{kind}"] += 1

    def corrupt(self, scale):
        s = scale.clone()
        v = self.rng.choice([math.nan, math.inf, -1.0])
        s.view(-1)[self.rng.randrange(s.numel())] = v
        return s

    def step_refused(self, kind=None):
        kind = kind or self.rng.choices(["bad_scale", "bad_scale_beside_valid", "bad_scale_in_session",
                                         "too_many_tokens", "bad_ids"], [3, 2, 2, 1, 1])[0]
        if kind == "too_many_tokens":
            x = self.draw_x(self.M + 1).to(self.dev)
            self.expect_error(kind, ValueError, lambda: self.dut(x))
            return
        if kind == "bad_ids":
            T = self.rng.randint(1, self.M)
            ids, w = self.draw_routing(T, "uniform")
            ids[self.rng.randrange(T), self.rng.randrange(self.K)] = self.rng.choice([-1, self.E, self.E + 7])
            x = self.draw_x(T).to(self.dev)
            self.expect_error(kind, ValueError, lambda: self.dut(x, ids.to(self.dev), w.to(self.dev)))
            return
        before = (self.dut.weight_bytes(), self.ref.weight_bytes())
        bad = self.new_pair(*self.rng.choice(self.projections()))
        bad[1] = (bad[1][0], self.corrupt(bad[1][1]))
        if kind == "bad_scale":
            call = bad
        else:
            call = [p for item in self.new_items(1) for p in item] + bad
            self.rng.shuffle(call)
        if kind == "bad_scale_in_session":
            # Refused inside a direct session, which then brings a valid pair and closes.
            good = [p for item in self.new_items(1) for p in item]
            for layer in (self.dut, self.ref):
                with layer.reloading(mode="direct"):
                    self.expect_error(kind, ValueError, lambda: self.load(layer, call))
                    self.load(layer, good)
            self.track_router([good])
            self.version += 1
            self.stats["reloads"] += 1
            self.stats["reloads_after_refused"] += 1
            self.stats["reload_tensors"] += len(good)
        else:
            for layer in (self.dut, self.ref):
                self.expect_error(kind, ValueError, lambda: self.load(layer, call))
            if (self.dut.weight_bytes(), self.ref.weight_bytes()) != before:
                self.fail(f"a refused load_weights call ({kind}) changed the weights")
        self.step_eager(T=min(self.M, 8), ext=False, mode="plain")  # the layer still gives the reference's bytes

    # ---------------------------------------------------------------- fused_moe

    def new_fused_set(self):
        E = self.E
        idx = torch.randint(0, 2 * E, (E,), generator=self.gen)
        ridx = torch.randint(0, 2 * E, (E,), generator=self.gen)
        j = int(torch.randint(0, 2, (1,), generator=self.gen))
        host = {}
        for k, (w, s) in self.bank.items():
            if k.startswith("shared"):
                host[k], host[k + "_scale"] = w[j], s[j]
            else:
                host[k], host[k + "_scale"] = gather(w, idx), s[idx]
        host["router"] = self.bank_router[ridx]
        if self.cfg.correction_bias:
            host["bias"] = self.new_bias()
        # The device tensors are made apart from the host ones (gathered on the device), each
        # a new allocation.
        dev = {}
        idx_d, ridx_d = idx.to(self.dev), ridx.to(self.dev)
        for k, (w, s) in self.bank_dev.items():
            if k.startswith("shared"):
                dev[k], dev[k + "_scale"] = w[j].clone(), s[j].clone()
            else:
                dev[k], dev[k + "_scale"] = gather(w, idx_d), s[idx_d]
        dev["router"] = self.bank_router_dev[ridx_d]
        if "bias" in host:
            dev["bias"] = host["bias"].to(self.dev) if self.cuda else host["bias"].clone()
        self.stats["fused_sets_made"] += 1
        return FusedSet(dev, host)

    def replace_fused_set(self, i=None):
        """A new set in slot i; the old set's tensors are dropped, and with them (at once) the
        layers fused_moe built over them."""
        i = self.rng.randrange(len(self.pool)) if i is None else i
        old = self.pool[i]
        refs = old.layers if old is not None else []
        self.fused_refs.pop(old.id if old is not None else None, None)
        if self.rng.random() < 0.5:
            self.pool[i] = self.new_fused_set()  # (allocated while the old tensors live)
            del old
        else:
            self.pool[i] = None
            del old  # (the new tensors may take the old addresses)
            self.pool[i] = self.new_fused_set()
        for r in refs:
            if r() is not None:
                self.fail("fused_moe kept a layer whose weight tensors were freed")
            else:
                self.stats["fused_layers_freed_with_weights"] += 1
        self.newest = i

    def fused_ref(self, s):
        ref = self.fused_refs.get(s.id)
        if ref is None:
            ref = megamoe.MoELayer.from_stacked(self.cfg, **s.host, device="cpu", max_tokens=self.M)
            self.fused_refs[s.id] = ref
            while len(self.fused_refs) > 8:
                self.fused_refs.popitem(last=False)
        else:
            self.fused_refs.move_to_end(s.id)
        return ref

    def fused_call(self, i, T=None, ext=None):
        rng = self.rng
        s = self.pool[i]
        if T is None:
            r = rng.random()
            T = 0 if r < 0.05 else 1 if r < 0.3 else self.M if r < 0.4 else self.draw_tokens(min(self.M, 32))
        ext = rng.random() < 0.8 if ext is None else ext
        x = self.draw_x(T)
        x_d = x.to(self.dev)
        t = s.t
        shared = {k: t[k] for k in ("shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale") if k in t}
        out = None
        if rng.random() < 0.3:
            out = torch.empty_like(x_d)
            out.view(torch.int16).fill_(POISON)
        if ext:
            ids, w = self.draw_routing(T, rng.choice(["uniform", "zipf", "one"]))
            ids = ids.to(rng.choice([torch.int32, torch.int64]))
            y = megamoe.ops.fused_moe(x_d, ids.to(self.dev), w.to(self.dev), t["w13"], t["w13_scale"], t["w2"],
                                      t["w2_scale"], config=self.cfg, out=out, **shared)
        else:
            y = megamoe.ops.fused_moe(x_d, None, None, t["w13"], t["w13_scale"], t["w2"], t["w2_scale"],
                                      config=self.cfg, router=t["router"], bias=t.get("bias"), out=out, **shared)
        if out is not None and y is not out:
            self.fail("fused_moe(out=...) returned another tensor")
        cache = megamoe.ops._cache
        layer = next(reversed(cache.values()))  # the layer this call used (the most recent entry)
        if not any(r() is layer for r in s.layers):
            s.layers.append(weakref.ref(layer))
            self.stats["fused_layers_built"] += 1
        if len(cache) > megamoe.ops.MAX_CACHED:
            self.fail(f"fused_moe's cache holds {len(cache)} layers, more than MAX_CACHED {megamoe.ops.MAX_CACHED}")
        self.stats["fused_calls"] += 1
        self.stats["tokens"] += T
        ref = self.fused_ref(s)
        what = f"fused_moe set {s.id}, {T} tokens, {'external' if ext else 'own'} routing"
        if ext:
            want = ref(x, ids, w)
        else:  # (the routing of the op's layer is this call's)
            want = self.expect_own(what, ref, x, layer.topk_ids[:T], layer.topk_weights[:T], s.host["router"],
                                   s.host.get("bias"))
        del layer  # (no reference kept: a dropped set's layer must go with its tensors)
        self.compare(what, y, want)

    def step_fused(self, calls=None):
        for _ in range(calls or self.rng.randint(1, 16)):
            if self.rng.random() < 0.3:
                self.replace_fused_set()
            i = self.newest if self.rng.random() < 0.7 else self.rng.randrange(len(self.pool))
            self.fused_call(i)

    def fill_fused_pool(self):
        for i in range(len(self.pool)):
            if self.pool[i] is None:
                self.pool[i] = self.new_fused_set()

    def touch_fused_pool(self):
        """One call on every set, in order: the cache then holds MAX_CACHED layers (more sets
        than that), the same state at both memory checkpoints."""
        for i in range(len(self.pool)):
            self.fused_call(i, T=1, ext=True)

    # ---------------------------------------------------------------- the custom op

    def step_torch_op(self, variant=None, ext=None):
        rng = self.rng
        variant = variant or rng.choice(["op", "op_out", "op_count"])
        ext = rng.random() < 0.5 if ext is None else ext
        T = self.draw_tokens(self.M)
        x = self.draw_x(T)
        x_d = x.to(self.dev)
        ids = w = ids_d = w_d = None
        if ext:
            ids, w = self.draw_routing(T, rng.choice(["uniform", "zipf", "one"]))
            ids = ids.to(rng.choice([torch.int32, torch.int64]))
            ids_d, w_d = ids.to(self.dev), w.to(self.dev)
        h = self.dut._handle
        n = T
        count = None
        if variant == "op_count":
            n = rng.randint(0, T) if T else 0
            count = torch.tensor([n], dtype=torch.int32, device=self.dev)
        if variant == "op_out":
            y = torch.empty_like(x_d)
            y.view(torch.int16).fill_(POISON)
            torch.ops.megamoe.moe_forward_out(h, x_d, y, ids_d, w_d, count)
        else:
            y = torch.ops.megamoe.moe_forward(h, x_d, ids_d, w_d, count)
        self.stats["forwards_torch_op"] += 1
        self.stats["tokens"] += n
        self.check_dut(f"torch op ({variant}), {n} of {T} tokens, {'external' if ext else 'own'} routing", y, x, n,
                       ids, w)
        if self.cuda:
            self.dut.check()

    # ---------------------------------------------------------------- the schedule

    STEP_KINDS = ("eager", "replays", "fused", "reload", "refused", "torch_op")
    STEP_WEIGHTS = (30, 15, 25, 15, 5, 10)

    def step(self, step_kind, **kw):
        self.step_no += 1
        self.step_kind = step_kind
        self.kinds[step_kind] += 1
        try:
            getattr(self, "step_" + step_kind)(**kw)
        except Exception as e:  # what a step expects, it catches itself
            self.stats["unexpected_errors"] += 1
            self.note(f"unexpected error: {type(e).__name__}: {e}")
            for layer in (self.dut, self.ref):  # (a session an error left open)
                if layer._impl.in_session():
                    try:
                        layer._impl.finish()
                    except Exception:
                        pass

    def warmup(self):
        """Every step kind once, forwards at every power-of-two token count (each count range
        has a tile configuration of its own, loaded at its first use), the fused pool
        filled and the cache full."""
        counts = sorted({0, self.M} | {1 << i for i in range(self.M.bit_length()) if 1 << i <= self.M})
        for T in counts:
            for ext, dt in ((False, None), (True, torch.int32), (True, torch.int64)):
                self.step("eager", T=T, ext=ext, dist="uniform", id_dtype=dt, mode="out")
        for kind in ("own", "ext32", "ext64"):
            self.step("replays", kind=kind, counts=counts)
        for kind in ("direct", "direct_session", "layerwise"):
            self.step("reload", kind=kind)
        for kind in ("bad_scale", "bad_scale_beside_valid", "bad_scale_in_session", "too_many_tokens", "bad_ids"):
            self.step("refused", kind=kind)
        for variant in ("op", "op_out", "op_count"):
            for ext in (False, True):
                self.step("torch_op", variant=variant, ext=ext)
        self.fill_fused_pool()
        for T in counts:
            self.fused_call(0, T=T, ext=True)
            self.fused_call(0, T=T, ext=False)
        self.step("fused", calls=16)
        self.touch_fused_pool()

    def checkpoint(self):
        """Memory at a quiet point: no replay epochs, the fused cache full, garbage
        collected, the device idle."""
        self.epochs.clear()
        self.touch_fused_pool()
        gc.collect()
        _malloc_trim()
        m = {"host_rss": host_rss(), "registry": len(megamoe_layer._registry),
             "fused_cache": len(megamoe.ops._cache)}
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            reserved = torch.cuda.memory_reserved()
            m.update(device_free=free, torch_allocated=torch.cuda.memory_allocated(), torch_reserved=reserved,
                     device_other=total - free - reserved)
        return m

    def run(self):
        a = self.a
        t0 = time.monotonic()
        self.warmup()
        self.warmup_steps = self.step_no
        m0 = self.checkpoint()
        t1 = time.monotonic()
        while True:
            if a.steps:
                if self.step_no >= a.steps:
                    break
            elif (time.monotonic() - t1 >= a.seconds and self.stats["reloads"] >= a.reloads
                  and self.stats["fused_calls"] >= a.fused_calls
                  and self.stats["replays"] + self.stats["forwards_counted"] >= a.replays):
                break
            if self.stats["unexpected_errors"] >= MAX_UNEXPECTED:
                self.note(f"stopped after {MAX_UNEXPECTED} unexpected errors")
                break
            self.step(self.rng.choices(self.STEP_KINDS, self.STEP_WEIGHTS)[0])
        m1 = self.checkpoint()
        return self.report(time.monotonic() - t0, time.monotonic() - t1, m0, m1)

    # ---------------------------------------------------------------- the report

    def report(self, total_s, run_s, m0, m1):
        a, st = self.a, self.stats
        memory = {
            "host_rss_after_warmup": m0["host_rss"], "host_rss_end": m1["host_rss"],
            "host_rss_growth": m1["host_rss"] - m0["host_rss"], "host_rss_bound": HOST_RSS_BOUND,
            "live_layers": [m0["registry"], m1["registry"]], "fused_cache": [m0["fused_cache"], m1["fused_cache"]],
            "device": None,
        }
        flat = memory["host_rss_growth"] < HOST_RSS_BOUND
        if not flat:
            self.note(f"host RSS grew by {memory['host_rss_growth']} bytes (bound {HOST_RSS_BOUND})")
        if m1["registry"] != m0["registry"]:
            flat = False
            self.note(f"live MoELayer objects: {m0['registry']} after the warm-up, {m1['registry']} at the end")
        if self.cuda:
            d = {k: [m0[k], m1[k]] for k in ("device_free", "torch_allocated", "torch_reserved", "device_other")}
            d["torch_allocated_growth"] = m1["torch_allocated"] - m0["torch_allocated"]
            d["device_other_growth"] = m1["device_other"] - m0["device_other"]
            d["device_free_drop"] = m0["device_free"] - m1["device_free"]
            d["device_other_bound"] = DEVICE_OTHER_BOUND
            d["cuda_module_loading"] = os.environ.get("CUDA_MODULE_LOADING", "")
            memory["device"] = d
            if d["torch_allocated_growth"] != 0:
                flat = False
                self.note(f"torch's allocated device memory grew by {d['torch_allocated_growth']} bytes")
            if d["device_other_growth"] > DEVICE_OTHER_BOUND:
                flat = False
                self.note(f"device memory outside torch's allocator grew by {d['device_other_growth']} bytes (a "
                          "kernel first loaded after the warm-up shows here too: CUDA_MODULE_LOADING=EAGER tells "
                          "it from a leak)")
        errors = {k: dict(v) for k, v in sorted(self.errors.items())}
        ok = (st["mismatches"] == 0 and st["unexpected_errors"] == 0 and st["missing_errors"] == 0 and flat
              and all(v["expected"] == v["raised"] for v in errors.values()))
        return {
            "ok": ok,
            "seed": a.seed,
            "command": replay_command(self.argv, a.seed),
            "device": a.device,
            "device_name": torch.cuda.get_device_name() if self.cuda else (platform.processor() or "cpu"),
            "megamoe_version": megamoe.__version__,
            "torch_version": torch.__version__,
            "config": dataclasses.asdict(self.cfg),
            "max_tokens": self.M,
            "seconds": round(total_s, 2),
            "seconds_after_warmup": round(run_s, 2),
            "warmup_steps": self.warmup_steps,
            "steps": self.step_no,
            "step_kinds": dict(self.kinds),
            "tokens": st["tokens"],
            "forwards": {
                "eager_own": st["forwards_eager_own"], "eager_external": st["forwards_eager_external"],
                "replays": st["replays"], "eager_device_count": st["forwards_eager_device_count"],
                "counted": st["forwards_counted"], "fused_moe": st["fused_calls"],
                "torch_op": st["forwards_torch_op"],
            },
            "reloads": st["reloads"],
            "reload_kinds": {k[len("reloads_"):]: v for k, v in sorted(st.items()) if k.startswith("reloads_")},
            "reload_tensors": st["reload_tensors"],
            "fused": {
                "calls": st["fused_calls"], "sets_made": st["fused_sets_made"], "pool": len(self.pool),
                "layers_built": st["fused_layers_built"],
                "layers_freed_with_weights": st["fused_layers_freed_with_weights"],
                "max_cached": megamoe.ops.MAX_CACHED,
            },
            "errors": errors,
            "refused_as_expected": sum(v["raised"] for v in errors.values()),
            "unexpected_errors": st["unexpected_errors"],
            "missing_errors": st["missing_errors"],
            "compared_rows": st["compared_rows"],
            "routing_checked": st["routing_checked"],
            "routing_near_ties": st["routing_near_ties"],
            "mismatches": st["mismatches"],
            "memory": memory,
            "failures": self.failures,
        }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    print(f"soak: seed {a.seed}; replay: {replay_command(argv, a.seed)}", flush=True)
    if a.device == "cuda" and not megamoe.cuda_available():
        print("soak: --device cuda: this megamoe build has no CUDA backend or no sm_90 GPU is present",
              file=sys.stderr)
        return 2
    # The tensors are small: torch's intra-op threads would cost more than they give, and
    # one thread keeps the run's pace independent of the machine's other load.
    torch.set_num_threads(1)
    r = Soak(a, argv).run()
    f = r["forwards"]
    print(f"soak: {'ok' if r['ok'] else 'FAILED'}: {r['steps']} steps in {r['seconds']} s ({r['device_name']}, "
          f"megamoe {r['megamoe_version']}, seed {r['seed']}), {r['tokens']} tokens; forwards: eager "
          f"{f['eager_own']} own / {f['eager_external']} external / {f['eager_device_count']} device count, "
          f"replays {f['replays']}, counted {f['counted']}, "
          f"fused_moe {f['fused_moe']}, torch op {f['torch_op']}; reloads {r['reloads']} "
          f"({r['reload_tensors']} tensors); refused as expected {r['refused_as_expected']}; unexpected errors "
          f"{r['unexpected_errors']}, missing errors {r['missing_errors']}; mismatches {r['mismatches']} "
          f"({r['compared_rows']} rows compared)")
    mem = r["memory"]
    line = f"soak: host RSS {mem['host_rss_after_warmup']} -> {mem['host_rss_end']} bytes"
    if mem["device"]:
        d = mem["device"]
        line += (f"; torch allocated growth {d['torch_allocated_growth']}, device memory outside torch growth "
                 f"{d['device_other_growth']}, free memory drop {d['device_free_drop']} bytes")
    print(line)
    for fl in r["failures"]:
        print(f"soak: {fl}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=2)
            fh.write("\n")
        print(f"wrote {a.json}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
