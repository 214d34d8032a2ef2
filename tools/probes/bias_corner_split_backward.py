"""Bias corner: instead of the padding-mask backward (slow with a bias), run the no-padding-mask
backward on the first s_kv-1 keys (views, residue 63: clean on 9.19) and add the last key's
contribution. Checks correctness with fully masked rows + adversarial rows, and times the parts."""
import math, os, sys, time, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
src = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_fe_sweep.py")).read()  # copy ../shared/cudnn_frontend/probe_fe_sweep.py beside this file
exec(src.split("rnd = random.Random")[0])

def tail(q, k, v, o, do, lse, bias, scale):
    kl, vl = k[:, :, -1].float(), v[:, :, -1].float()
    s = torch.einsum("bhqd,bhd->bhq", q.float(), kl) * scale
    if bias is not None: s = s + bias[..., -1].float().expand_as(s)
    p = torch.exp(s - lse.squeeze(-1)); p = torch.where(torch.isfinite(p), p, torch.zeros_like(p))
    dp = torch.einsum("bhqd,bhd->bhq", do.float(), vl); Dr = (do.float() * o.float()).sum(-1)
    dsv = p * (dp - Dr)
    return dsv.unsqueeze(-1) * kl.unsqueeze(2) * scale, torch.einsum("bhq,bhqd->bhd", dsv, q.float()) * scale, torch.einsum("bhq,bhqd->bhd", p, do.float())

def split_bwd(q, k, v, o, do, lse, bias, scale):
    """backward of the first S-1 keys through views, then the last key added."""
    B, H, Sq, D = q.shape; S = k.shape[2]
    dq = torch.empty_like(q); dk = torch.empty_like(k); dv = torch.empty_like(v)
    kv, vv, dkv, dvv = k[:, :, :S - 1], v[:, :, :S - 1], dk[:, :, :S - 1], dv[:, :, :S - 1]
    bv = None if bias is None else bias[..., :S - 1]
    run_bwd_views(q, kv, vv, o, do, lse, bv, scale, dq, dkv, dvv)
    tq, tk, tv = tail(q, k, v, o, do, lse, bias, scale)
    dq.copy_((dq.float() + tq).to(q.dtype)); dk[:, :, -1] = tk.to(k.dtype); dv[:, :, -1] = tv.to(v.dtype)
    return dq, dk, dv

_cache = {}
def graph(kind, q, k, v, o, bias, pad, scale, dq=None, dk=None, dv=None):
    h = lambda t: None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)
    key = (kind, h(q), h(k), h(v), h(o), h(bias), pad, h(dq), h(dk), h(dv))
    if key in _cache: return _cache[key]
    io = DT[q.dtype]; B, Hq, Sq, D = q.shape
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=F32, compute_data_type=F32, handle=H_)
    T = {n: g.tensor(name=n, dim=ds(x)[0], stride=ds(x)[1], data_type=io) for n, x in (("q", q), ("k", k), ("v", v))}
    kw = dict(attn_scale=scale)
    if bias is not None:
        T["bias"] = g.tensor(name="bias", dim=ds(bias)[0], stride=ds(bias)[1], data_type=io); kw["bias"] = T["bias"]
    if pad:
        T["slq"] = g.tensor(name="slq", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
        T["slk"] = g.tensor(name="slk", dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=I32)
        kw.update(use_padding_mask=True, seq_len_q=T["slq"], seq_len_kv=T["slk"])
    if kind == "f":
        O, St = g.sdpa(name="f", q=T["q"], k=T["k"], v=T["v"], generate_stats=True, **kw)
        O.set_output(True).set_dim(ds(o)[0]).set_stride(ds(o)[1]).set_data_type(io)
        St.set_output(True).set_dim([B, Hq, Sq, 1]).set_stride([Hq * Sq, Sq, 1, 1]).set_data_type(F32)
        T["o"], T["st"] = O, St
    else:
        T["o"] = g.tensor(name="o", dim=ds(o)[0], stride=ds(o)[1], data_type=io)
        T["do"] = g.tensor(name="do", dim=ds(o)[0], stride=ds(o)[1], data_type=io)
        T["st"] = g.tensor(name="st", dim=[B, Hq, Sq, 1], stride=[Hq * Sq, Sq, 1, 1], data_type=F32)
        a, b_, c = g.sdpa_backward(name="b", q=T["q"], k=T["k"], v=T["v"], o=T["o"], dO=T["do"], stats=T["st"], **kw)
        for t, x in ((a, dq), (b_, dk), (c, dv)): t.set_output(True).set_dim(ds(x)[0]).set_stride(ds(x)[1]).set_data_type(io)
        T["dq"], T["dk"], T["dv"] = a, b_, c
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device=dev)
    _cache[key] = (g, T, ws); return _cache[key]

def run_fwd(q, k, v, bias, pad, scale):
    B, Hq, Sq, D = q.shape
    o = torch.empty_like(q); lse = torch.empty(B, Hq, Sq, 1, device=dev, dtype=torch.float32)
    g, T, ws = graph("f", q, k, v, o, bias, pad, scale)
    vp = {T["q"]: q, T["k"]: k, T["v"]: v, T["o"]: o, T["st"]: lse}
    if bias is not None: vp[T["bias"]] = bias
    if pad:
        vp[T["slq"]] = torch.full((B, 1, 1, 1), Sq, dtype=torch.int32, device=dev)
        vp[T["slk"]] = torch.full((B, 1, 1, 1), k.shape[2], dtype=torch.int32, device=dev)
    g.execute(vp, ws, handle=H_); return o, lse

def run_bwd_views(q, k, v, o, do, lse, bias, scale, dq, dk, dv, pad=False):
    B, Hq, Sq, D = q.shape
    g, T, ws = graph("b", q, k, v, o, bias, pad, scale, dq, dk, dv)
    vp = {T["q"]: q, T["k"]: k, T["v"]: v, T["o"]: o, T["do"]: do, T["st"]: lse, T["dq"]: dq, T["dk"]: dk, T["dv"]: dv}
    if bias is not None: vp[T["bias"]] = bias
    if pad:
        vp[T["slq"]] = torch.full((B, 1, 1, 1), Sq, dtype=torch.int32, device=dev)
        vp[T["slk"]] = torch.full((B, 1, 1, 1), k.shape[2], dtype=torch.int32, device=dev)
    g.execute(vp, ws, handle=H_)

def pad_bwd(q, k, v, o, do, lse, bias, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    run_bwd_views(q, k, v, o, do, lse, bias, scale, dq, dk, dv, pad=True); return dq, dk, dv

def inputs(B, H, Sq, S, D, mask, adv, seed=0, dt=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, H, Sq, D, device=dev, generator=g) * 0.1; k = torch.randn(B, H, S, D, device=dev, generator=g) * 0.1
    v = torch.randn(B, H, S, D, device=dev, generator=g); do = torch.randn(B, H, Sq, D, device=dev, generator=g)
    k[..., 0] += 10.0
    if adv: q[:, :, -1] = 0; q[:, :, -1, 0] = -115 * math.sqrt(D) / 10; q[:, :, Sq // 3] = 0; q[:, :, Sq // 3, 0] = -115 * math.sqrt(D) / 10
    allow = None
    if mask == "leftpad":
        allow = torch.ones(Sq, S, dtype=torch.bool, device=dev).tril(S - Sq)[None, None].repeat(B, 1, 1, 1)
        for b in range(B): allow[b, :, :, :[0, 37, 301, 650][b % 4] * S // 704] = False
    elif mask == "keys":
        allow = torch.rand(B, 1, 1, S, device=dev, generator=g) > 0.2; allow[..., 0] = True
    elif mask == "random":
        allow = torch.rand(B, 1, Sq, S, device=dev, generator=g) > 0.3
    q, k, v, do = (x.to(dt).contiguous() for x in (q, k, v, do))
    bias = None if allow is None else torch.zeros(allow.shape, device=dev, dtype=dt).masked_fill(~allow, float("-inf"))
    if bias is not None and bias.shape[2] == 1: bias = bias.expand(B, 1, Sq, S).contiguous()
    return q, k, v, do, allow, bias

print("== correctness", flush=True)
for (B, H, Sq, S, D, mask, dt) in [(4, 8, 704, 704, 128, "leftpad", torch.bfloat16), (4, 8, 704, 704, 64, "random", torch.float16),
                                   (4, 8, 360, 64, 128, "keys", torch.bfloat16), (2, 8, 300, 4032, 128, "keys", torch.bfloat16),
                                   (1, 8, 1, 704, 128, "keys", torch.bfloat16), (4, 8, 704, 705, 128, "leftpad", torch.bfloat16),
                                   (4, 8, 200, 576, 256, "random", torch.bfloat16)]:
    q, k, v, do, allow, bias = inputs(B, H, Sq, S, D, mask, True, dt=dt)
    scale = 1 / math.sqrt(D)
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ro = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allow)
    live = torch.isfinite(ro).all(-1, keepdim=True)
    ref = torch.autograd.grad(ro, (qf, kf, vf), torch.where(live, do.float(), 0))
    for name in ("fwd_nopad+split", "fwd_pad+split", "fwd_nopad+padbwd", "fwd_pad+padbwd", "fwd_nopad+plainbwd"):
        fpad = name.startswith("fwd_pad")
        o, lse = run_fwd(q, k, v, bias, fpad, scale)
        if "split" in name: dq, dk, dv = split_bwd(q, k, v, o, do, lse, bias, scale)
        elif "padbwd" in name: dq, dk, dv = pad_bwd(q, k, v, o, do, lse, bias, scale)
        else:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v); run_bwd_views(q, k, v, o, do, lse, bias, scale, dq, dk, dv)
        torch.cuda.synchronize()
        full = ~live
        lse_full = lse[full[..., :1].expand_as(lse)] if full.any() else torch.zeros(0)
        dqm = torch.where(live, dq.float(), 0)
        print(f"{B}x{H}x{Sq}x{S} D{D} {mask} {str(dt)[6:]} {name}: nonfinite o/dq/dk/dv {nf(o)}/{nf(dq)}/{nf(dk)}/{nf(dv)} "
              f"err o {nerr(torch.where(live, o.float(), 0), torch.where(live, ro, 0).detach()):.2e} dq(live) {nerr(dqm, ref[0]):.2e} dk {nerr(dk, ref[1]):.2e} dv {nerr(dv, ref[2]):.2e}"
              f" | full rows {int(full.sum())}, their lse {lse_full.unique()[:3].tolist()} |o| {float(torch.where(full, o.float(), 0).abs().max()):.3g}", flush=True)

print("== timing (event, median of 20, fwd+bwd)", flush=True)
def evt(fn, n=20):
    for _ in range(4): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a = torch.cuda.Event(True); b = torch.cuda.Event(True); a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2]
for (B, H, Sq, S, mask) in [(16, 24, 704, 704, "random"), (32, 24, 360, 64, "keys"), (4, 24, 4096, 4032, "keys"), (32, 24, 32, 64, "keys"), (16, 24, 704, 704, None)]:
    q, k, v, do, allow, bias = inputs(B, H, Sq, S, 128, mask, False)
    scale = 1 / math.sqrt(128)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    def stock():
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=allow); torch.autograd.grad(out, (qq, kk, vv), do)
    o, lse = run_fwd(q, k, v, bias, False, scale)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    def fe_plain(): run_fwd(q, k, v, bias, False, scale); run_bwd_views(q, k, v, o, do, lse, bias, scale, dq, dk, dv)
    def fe_pad(): run_fwd(q, k, v, bias, True, scale); pad_bwd(q, k, v, o, do, lse, bias, scale)
    bv = None if bias is None else bias[..., :S - 1]
    def fe_split_main(): run_fwd(q, k, v, bias, False, scale); run_bwd_views(q, k[:, :, :S-1], v[:, :, :S-1], o, do, lse, bv, scale, dq, dk[:, :, :S-1], dv[:, :, :S-1])
    def tail_proxy(): torch.addcmul(dq, q, do, out=dq); torch.mul(o, 1.0)  # reads q,do,o + rmw dq
    r = {n: evt(f) for n, f in (("stock", stock), ("fe_plain", fe_plain), ("fe_pad", fe_pad), ("fe_split_main", fe_split_main), ("tail_proxy", tail_proxy), ("stock2", stock))}
    base = (r["stock"] + r["stock2"]) / 2
    print(f"{B}x24x{Sq}x{S} {mask}: stock {base:.3f} ms; " + ", ".join(f"{n} {t/base:.3f}" for n, t in r.items()), flush=True)
