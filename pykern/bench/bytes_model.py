"""Bytes model of pykern's memory-bound ops at LLaMA-sized shapes (no GPU needed).

    python tools/bytes_model.py [--group forward|training] [--dtype bf16|f32] [--json]

(tools/bytes_model.py is a thin wrapper around this module; `python -m pykern.bench` uses its shapes and
puts the modelled HBM bytes beside the measured times.)

Per op and shape: the minimum bytes the op must move (each input read once, each output written once),
the bytes the kernels *issue* (every global load/store of their access pattern and launch geometry, re-reads
included), the bytes that reach HBM (issued minus the re-reads that the model counts as L2 hits: a row
re-read by the same block while the resident blocks' rows fit in half of L2), and the modelled H100 time
at 3.35 TB/s for both. tools/bench_forward.py and tools/bench_training.py print the table of their ops.

Shapes: LLaMA-3-8B-like, 8192 tokens (4 x 2048), hidden 4096, FFN 14336, 32 query / 8 KV heads of 128,
vocabulary 128256. The models follow kernels_cu/forward.cu, training.cu and norm_act_loss.cu as of this commit.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Iterator

H100_BW = 3.35e12  # bytes/s, H100 SXM HBM3
H100_L2 = 50 * 2**20
H100_SMS = 132

TOKENS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, SEQ = 8192, 4096, 14336, 32, 8, 128, 128256, 2048
WIDE_HIDDEN = 32768  # the wide-row norm backward's hidden size (rows past one CTA's 8192 columns)


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    min_bytes: int
    issued_bytes: int
    hbm_bytes: int
    note: str

    @property
    def roofline_us(self) -> float:
        return self.min_bytes / H100_BW * 1e6

    @property
    def model_us(self) -> float:
        return self.hbm_bytes / H100_BW * 1e6

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(roofline_us=round(self.roofline_us, 2), model_us=round(self.model_us, 2),
                 hbm_over_min=round(self.hbm_bytes / self.min_bytes, 3))
        return d


def rms_bwd_blocks(rows: int, dim: int) -> int:
    """Blocks of the fused rms_norm_backward (pykern.ops.training.rms_backward_geometry)."""
    threads = max(32, -(-dim // (16 * 32)) * 32)
    return min(rows, 512, 512 * H100_SMS // threads)


def ln_bwd_blocks(rows: int, dim: int, e: int) -> int:
    """Blocks of the fused layer_norm_backward (pykern.ops.norm_act_loss._lnb_fused_geometry)."""
    chunks = dim // (16 // e)
    threads = max(128, -(-chunks // 64) * 32)
    return min(rows, 512 * H100_SMS // threads)


def _reread_hits(row_bytes: int, rows_resident: int) -> bool:
    """Does a block's second pass over its row(s) find them in L2? (all resident rows in half of L2)."""
    return row_bytes * rows_resident <= H100_L2 // 2


def rope_rows(e: int) -> Iterator[Row]:
    """rope / qk_norm_rope (forward, one launch for q and k) and qk_norm_rope_backward at TOKENS tokens."""
    from pykern.ops.forward import _rope_units

    t, d, heads = TOKENS, HEAD_DIM, HEADS + KV_HEADS
    dt = "bf16" if e == 2 else "f32"
    n = t * heads * d
    tab = 2 * t * (d // 2) * 4
    hpu, units = _rope_units(t, heads, d, e)
    issued_tab = tab * (units // t)  # each unit of a token re-reads its entries (L1 / L2)
    shape = f"{t}x({HEADS}+{KV_HEADS})x{d}"
    yield Row("rope (q+k)", shape, dt, 2 * n * e + tab, 2 * n * e + issued_tab, 2 * n * e + tab,
              "one launch, tables once per unit" if units > t else "one launch, tables once per token")
    w = 2 * d * e  # q_norm and k_norm weights: read per unit, from L1 / L2 after the first
    yield Row("qk_norm_rope", shape, dt, 2 * n * e + tab + w, 2 * n * e + issued_tab + units * w,
              2 * n * e + tab + w, "norm fused: x read once")
    blocks = max(1, min(4096, -(-units // 8)))  # pykern.ops.forward: 8 warps a block, at most 4096 blocks
    parts = 2 * 2 * blocks * d * 4  # two weights' fp32 partial rows, written then read by norm_grad_reduce
    yield Row("qk_norm_rope_backward", shape, dt, 3 * n * e + tab + 2 * w, 3 * n * e + issued_tab + units * w + w
              + parts, 3 * n * e + tab + 2 * w + parts, "x, grad read once; partial rows")


def forward_rows(e: int) -> Iterator[Row]:
    t, h = TOKENS, HIDDEN
    # rms_norm: pass 1 reads x (sum of squares), pass 2 reads x and weight, writes out. One row per
    # block (or warp); resident rows ~ SMs x 2 blocks of 1024 threads.
    # rms_norm: a row of <= 2 x 1024 16-byte vectors is held in registers: x read once, weight per row (L1/L2)
    n = t * h
    cached = h * e <= 2 * 1024 * 16
    row_hit = _reread_hits(h * e, H100_SMS * 2)
    yield Row("rms_norm", f"{t}x{h}", "bf16" if e == 2 else "f32", 2 * n * e + h * e,
              (2 if cached else 3) * n * e + t * h * e,
              2 * n * e + h * e + (0 if cached or row_hit else n * e),
              "one read (row in registers)" if cached else "2nd read of x from L2")
    # silu_gate: gate, up read once, out written once (16-byte vectors, grid-stride)
    n = t * FFN
    yield Row("silu_gate", f"{t}x{FFN}", "bf16" if e == 2 else "f32", 3 * n * e, 3 * n * e, 3 * n * e, "")
    yield Row("silu_gate_backward", f"{t}x{FFN}", "bf16" if e == 2 else "f32", 5 * n * e, 5 * n * e, 5 * n * e, "")
    # rope: q and k in one launch (16-byte accesses), x read once and written once; each warp unit of heads of a
    # token reads the compact fp32 cos/sin (T x D/2 each) once, so the tables are issued once per unit
    # (once per token at this size: pykern.ops.forward's unit geometry)
    yield from rope_rows(e)
    # causal_attn_softmax (f32 scores, one sequence of SEQ): reads the visible half twice, writes all
    n = SEQ * HEADS * SEQ
    vis = HEADS * SEQ * (SEQ + 1) // 2
    hit = _reread_hits(SEQ * 4, H100_SMS * 2)
    yield Row("causal_attn_softmax", f"{SEQ}x{HEADS}x{SEQ}", "f32", (vis + n) * 4, (2 * vis + n) * 4,
              (vis + n) * 4 + (0 if hit else vis * 4), "masked tail written, never read")
    # layer_norm: the row held in registers (<= 4 16-byte chunks a thread): x read once, w and b per row (L1)
    n = t * h
    yield Row("layer_norm", f"{t}x{h}", "bf16" if e == 2 else "f32", 2 * n * e + 2 * h * e,
              2 * n * e + 2 * t * h * e, 2 * n * e + 2 * h * e, "one read (row in registers)")
    # add_rms_norm (rows of <= 2 16-byte chunks a thread at 512 threads): pass 1 reads x, residual, writes
    # new_residual and reads it back (as stored: rounded; the thread's own line, L1); pass 2 takes h from
    # registers, reads w, writes y.
    yield Row("add_rms_norm", f"{t}x{h}", "bf16" if e == 2 else "f32", 4 * n * e + h * e,
              5 * n * e + t * h * e, 4 * n * e + h * e, "new_residual read back once (L1), h in registers")
    # GELU family: elementwise, 16-byte vectors, one vector a thread. HBM = the minimum (the exact form's issue:
    # docs/membound.md)
    n = t * FFN
    for name, arrays_ in (("gelu", 2), ("gelu_backward", 3), ("gelu_gate", 3), ("gelu_gate_backward", 5)):
        yield Row(name, f"{t}x{FFN}", "bf16" if e == 2 else "f32", arrays_ * n * e, arrays_ * n * e,
                  arrays_ * n * e, "")
    # embedding: ids (8 B each) + gathered rows + output rows
    yield Row("embedding", f"{t} ids, {VOCAB}x{h}", "bf16" if e == 2 else "f32", t * 8 + 2 * t * h * e,
              t * 8 + 2 * t * h * e, t * 8 + 2 * t * h * e, "")


def training_rows(e: int) -> Iterator[Row]:
    t, h = TOKENS, HIDDEN
    dt = "bf16" if e == 2 else "f32"
    n = h * FFN
    yield Row("transpose_2d", f"{h}x{FFN}", dt, 2 * n * e, 2 * n * e, 2 * n * e,
              "64x64 tiles, 16-byte vectors both sides")
    # softmax_backward over attention-prob rows: p, g read once when the row is <= 2 16-byte chunks a thread of
    # 512 (kept in registers), else twice (dot pass, output pass); grad_in written
    n = SEQ * HEADS * SEQ
    if SEQ * e <= 2 * 512 * 16:
        yield Row("softmax_backward", f"{SEQ * HEADS}x{SEQ}", dt, 3 * n * e, 3 * n * e, 3 * n * e,
                  "one read (row in registers)")
    else:
        hit = _reread_hits(2 * SEQ * e, H100_SMS)
        yield Row("softmax_backward", f"{SEQ * HEADS}x{SEQ}", dt, 3 * n * e, 5 * n * e,
                  3 * n * e + (0 if hit else 2 * n * e), "2nd pass from L2 (row fits)")
    # rms_norm_backward, fused (dim <= 16 x 512): one wave of blocks (264 of 256 threads at dim 4096, 512
    # threads' worth an SM of 132) walks the rows; each thread loads x and g of its 2 (bf16) / 4 (f32) 16-byte
    # chunks into registers (all issued before the first sum: one read of each), the weights twice a row from
    # L1, writes gx, and sums x * r * g per column in registers; each block writes one fp32 partial row that
    # norm_grad_reduce reads back. HBM: 3N + 2 x n_part x dim x 4 + inv_rms + grad_weight.
    n = t * h
    parts = rms_bwd_blocks(t, h)
    partials = parts * h * 4
    yield Row("rms_norm_backward", f"{t}x{h}", dt, 3 * n * e + 2 * h * e + t * 4,
              3 * n * e + 2 * t * h * e + 2 * partials + t * 4 + h * 4,
              3 * n * e + h * e + 2 * partials + t * 4 + h * 4,
              f"one read of x and g (row in registers), {parts} partial rows")
    # rms_norm_backward of wide rows (hidden WIDE_HIDDEN, past the 16 x 512 columns one CTA holds). One CTA a row:
    # x and g read for the row sums and again for grad_x (the 2nd pass an L1/L2 hit: 132 resident rows of 64 KB fit
    # half of L2), the weights twice a row from L1, then rms_norm_backward_weight reads x and g again from HBM (and
    # inv_rms) into weight_chunks' partial rows. The sm_90a cluster kernel (norm_sm90.cu): a cluster splits the row
    # and keeps its slices in registers (the row sums travel over DSMEM), so x and g are read once, each cluster
    # writes one fp32 partial row. HBM: 3N + 2 x partials + inv_rms + grad_weight + the weights.
    from pykern.ops._common import weight_chunks
    from pykern.ops.training import rms_backward_cluster_plan

    hw = WIDE_HIDDEN
    n = t * hw
    chunks = weight_chunks(t, hw)[0]
    partials = chunks * hw * 4
    yield Row("rms_norm_backward (wide, one CTA)", f"{t}x{hw}", dt, 3 * n * e + 2 * hw * e + t * 4,
              5 * n * e + 2 * t * hw * e + 2 * partials + 2 * t * 4 + hw * 4,
              5 * n * e + hw * e + 2 * partials + 2 * t * 4 + hw * 4,
              f"one CTA a row: x and g read again by the weight kernel, {chunks} partial row(s)")
    clusters, nc, slice_, _ = rms_backward_cluster_plan(t, hw)
    partials = clusters * hw * 4
    yield Row("rms_norm_backward (wide, sm_90a cluster)", f"{t}x{hw}", dt, 3 * n * e + 2 * hw * e + t * 4,
              3 * n * e + 2 * t * hw * e + 2 * partials + t * 4 + hw * 4,
              3 * n * e + hw * e + 2 * partials + t * 4 + hw * 4,
              f"{clusters} clusters of {nc} CTAs x {slice_} columns: one read of x and g, {clusters} partial rows")
    n = t * h
    # layer_norm_backward, fused (dim % 16 bytes == 0, 64 < chunks <= 2 x 512): as rms_norm_backward, with
    # the weight and the bias gradient (two partial rows a block) and the row's mean / rstd written (8 B a row)
    parts = ln_bwd_blocks(t, h, e)
    partials = 2 * parts * h * 4
    yield Row("layer_norm_backward", f"{t}x{h}", dt, 3 * n * e + 3 * h * e,
              3 * n * e + 2 * t * h * e + 2 * partials + 8 * t + 2 * h * 4,
              3 * n * e + h * e + 2 * partials + 8 * t + 2 * h * 4,
              f"one read of x and g (row in registers), 2 x {parts} partial rows")
    # add_rms_norm_backward, fused as layer_norm_backward: h and grad_y read once (registers), grad_new_residual
    # read, grad_h written, one fp32 partial row a block for the weight gradient
    parts = ln_bwd_blocks(t, h, e)
    yield Row("add_rms_norm_backward", f"{t}x{h}", dt, 4 * n * e + 2 * h * e,
              4 * n * e + 2 * t * h * e + 2 * parts * h * 4 + t * 4 + h * 4,
              4 * n * e + h * e + 2 * parts * h * 4 + t * 4 + h * 4,
              f"one read of h and g (row in registers), {parts} partial rows")
    # embedding_backward: each token's grad row gathered once (8-byte accesses of bf16), the fp32 table
    # written whole; the bucket sort reads the ids twice per 2048-row vocab block (L2) and writes order/offsets
    blocks = -(-VOCAB // 2048)
    yield Row("embedding_backward", f"{t}x{h} -> {VOCAB}x{h}", dt, t * h * e + t * 8 + VOCAB * h * 4,
              t * h * e + 2 * blocks * t * 8 + VOCAB * h * 4 + t * 4 + (VOCAB + 1) * 4 * 2,
              t * h * e + t * 8 + VOCAB * h * 4 + t * 4 + (VOCAB + 1) * 4 * 2, "ids re-read per vocab block from L2")
    # cross_entropy_fwd_bwd: stats pass + gradient pass over 128K-wide rows
    n = t * VOCAB
    yield Row("cross_entropy_fwd_bwd", f"{t}x{VOCAB}", dt, 2 * n * e + t * 8, 3 * n * e + t * 8,
              3 * n * e + t * 8, "rows of 256 KB evicted between passes (two reads and one write by design)")
    # the sm_90a cluster kernel (cross_entropy_sm90.cu): the row resident in a cluster's shared memory, so the
    # gradient sweep reads no logits: one read and one write (the partials travel over DSMEM, not HBM)
    from pykern.ops.training import cross_entropy_cluster_plan

    nc, slice_, _ = cross_entropy_cluster_plan(VOCAB, e)
    yield Row("cross_entropy_fwd_bwd (sm_90a cluster)", f"{t}x{VOCAB}", dt, 2 * n * e + t * 8, 2 * n * e + t * 8,
              2 * n * e + t * 8, f"clusters of {nc} CTAs x {slice_ * e / 1024:.1f} KiB of the row in shared memory: "
              "logits read once")


def rows(group: str, e: int) -> list[Row]:
    if group == "forward":
        return list(forward_rows(e))
    if group == "training":
        return list(training_rows(e))
    return list(forward_rows(e)) + list(training_rows(e))


def table(rs: list[Row]) -> str:
    head = ["op", "shape", "dtype", "min MB", "issued MB", "HBM MB", "HBM/min", "roofline us", "model us", "note"]
    body = [[r.op, r.shape, r.dtype, f"{r.min_bytes / 1e6:.1f}", f"{r.issued_bytes / 1e6:.1f}",
             f"{r.hbm_bytes / 1e6:.1f}", f"{r.hbm_bytes / r.min_bytes:.2f}", f"{r.roofline_us:.1f}",
             f"{r.model_us:.1f}", r.note] for r in rs]
    w = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = lambda x: "  ".join(c.ljust(w[i]) if i in (0, 1, 2, 9) else c.rjust(w[i]) for i, c in enumerate(x))
    return "\n".join([f"bytes model, H100 at {H100_BW / 1e12:.2f} TB/s (modelled, no GPU):", fmt(head),
                      fmt(["-" * x for x in w]), *map(fmt, body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--group", choices=("forward", "training", "all"), default="all")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rs = rows(a.group, 2 if a.dtype == "bf16" else 4)
    print(json.dumps([r.to_dict() for r in rs], indent=2) if a.json else table(rs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
