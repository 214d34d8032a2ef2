"""Probe: the host time of a cuDNN SDPA graph build, heuristics {A} (ATen's) vs {A, FALLBACK} (the op's)."""
import math, sys, time, json, statistics
import torch
import cudnn
HANDLE = cudnn.create_handle()
BF, F32, I32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT, cudnn.data_type.INT32


def g_new():
    return cudnn.pygraph(io_data_type=BF, intermediate_data_type=F32, compute_data_type=F32, handle=HANDLE)


def tt(g, name, t, dt=BF):
    return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dt)

dev = "cuda"
MODES = {"A": [cudnn.heur_mode.A], "A+FALLBACK": [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]}


def build(kind, modes, B, H, Sq, Skv, D, bias_on, padding):
    q = torch.empty(B, H, Sq, D, dtype=torch.bfloat16, device=dev)
    k = torch.empty(B, H, Skv, D, dtype=torch.bfloat16, device=dev)
    bias = torch.empty(B, 1, Sq, Skv, dtype=torch.bfloat16, device=dev) if bias_on else None
    g = g_new()
    T = {n: tt(g, n, x) for n, x in (("q", q), ("k", k), ("v", k))}
    kw = {}
    if bias_on:
        kw["bias"] = tt(g, "bias", bias)
    t = {}
    t0 = time.perf_counter()
    if kind == "fwd":
        o, st = g.sdpa(name="f", q=T["q"], k=T["k"], v=T["v"], generate_stats=True, attn_scale=0.1, **kw)
        o.set_output(True).set_dim([B, H, Sq, D]).set_stride([H * Sq * D, Sq * D, D, 1]).set_data_type(BF)
        st.set_output(True).set_dim([B, H, Sq, 1]).set_stride([H * Sq, Sq, 1, 1]).set_data_type(F32)
    else:
        o = tt(g, "o", q); do = tt(g, "do", q)
        st = g.tensor(name="st", dim=[B, H, Sq, 1], stride=[H * Sq, Sq, 1, 1], data_type=F32)
        if padding:
            kw["use_padding_mask"] = True
            kw["seq_len_q"] = g.tensor(name="slq", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
            kw["seq_len_kv"] = g.tensor(name="slk", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
        dq, dk, dv = g.sdpa_backward(name="b", q=T["q"], k=T["k"], v=T["v"], o=o, dO=do, stats=st, attn_scale=0.1, **kw)
        for x, ref in ((dq, q), (dk, k), (dv, k)):
            x.set_output(True).set_dim(list(ref.shape)).set_stride(list(ref.stride())).set_data_type(BF)
    for name, fn in (("validate", g.validate), ("op_graph", g.build_operation_graph),
                     ("plans", lambda: g.create_execution_plans(modes)), ("support", g.check_support),
                     ("build", g.build_plans)):
        a = time.perf_counter(); fn(); t[name] = (time.perf_counter() - a) * 1e3
    t["total"] = (time.perf_counter() - t0) * 1e3
    return t


res = {}
b = 5
for shape in ((24, 392, 392, 128, True, False), (24, 704, 704, 128, False, False),
              (24, 4096, 4032, 128, True, False), (24, 360, 64, 128, True, True)):
    for kind in ("fwd", "bwd"):
        for rnd in range(6):
            for mode in (("A", "A+FALLBACK") if rnd % 2 == 0 else ("A+FALLBACK", "A")):
                b += 1
                H, Sq, Skv, D, bias_on, padding = shape
                t = build(kind, MODES[mode], b, H, Sq, Skv, D, bias_on, padding and kind == "bwd")
                res.setdefault((str(shape), kind, mode), []).append(t)
for key, ts in res.items():
    med = {n: round(statistics.median(x[n] for x in ts), 2) for n in ts[0]}
    print(key, med, flush=True)
