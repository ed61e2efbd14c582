"""Chapters 11 and 12's GPT: the same model through torch ops and through the course's ops; its KV-cache
decoding, FLOP count and optimizer; the training benchmark's judging of losses and targets."""

import copy

import pytest
import torch

import course_utils as cu
from course_utils import check, gpt
from course_utils.autograd import registry


def test_corpus_is_the_courses_own_text():
    text = gpt.corpus_text()
    assert "Kernel Fusion with Triton" in text and len(text) > 10_000
    data = gpt.tokens("héllo")
    assert data.dtype == torch.int64 and data.tolist() == list("héllo".encode())


def test_batches_are_reproducible_windows_with_next_token_targets():
    data = torch.arange(1000)
    a = list(gpt.batches(data, 3, 16, 4, seed=5))
    b = list(gpt.batches(data, 3, 16, 4, seed=5))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    x, y = a[0]
    assert x.shape == (3, 16) and torch.equal(y, x + 1)
    with pytest.raises(ValueError, match="too few"):
        next(gpt.batches(torch.arange(10), 1, 16, 1))


def test_twins_start_from_identical_parameters():
    a, b = gpt.twins(gpt.TINY, cu.DEVICE, bf16=False)
    assert a.ops.name == "torch" and b.ops.name == "course"
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb) and pa.data_ptr() != pb.data_ptr()
    _, c = gpt.twins(gpt.TINY, cu.DEVICE, bf16=True)   # a GPU's default: the same weights rounded to bf16
    for (na, pa), (nc, pc) in zip(a.named_parameters(), c.named_parameters()):
        assert na == nc and torch.equal(pa.to(pc.dtype), pc), na


def test_course_ops_refuse_rather_than_fall_back(monkeypatch):
    monkeypatch.setitem(registry.COURSE_CANDIDATES, "attention", [("course_utils.no_such_module", "f", "nothing")])
    with pytest.raises(RuntimeError, match="no kernel yet for: attention"):
        registry.course_ops()
    assert any(r["op"] == "attention" and r["implementation"] == "missing" for r in registry.course_table())


def test_every_op_has_a_course_kernel_from_the_operator_module():
    table = registry.course_table()
    assert [r["op"] for r in table] == ["layer_norm", "add_layer_norm", "linear_gelu", "attention", "cross_entropy",
                                        "linear_cross_entropy"]
    assert all(r["implementation"] != "missing" for r in table), table
    assert registry.uses_library_ops(), table  # every op from torch.ops.course, none from chapter 11's fallbacks


def test_an_operator_still_a_skeleton_counts_as_missing(monkeypatch):
    monkeypatch.setattr(registry, "_unwritten", lambda package, op: op == "cross_entropy")
    row = next(r for r in registry.course_table() if r["op"] == "cross_entropy")
    assert "PyTorch's cross_entropy" in row["implementation"] and not registry.uses_library_ops()


def test_forward_and_gradients_agree_with_torch_ops():
    a, b = gpt.twins(gpt.TINY, cu.DEVICE)
    x, y = (t.to(cu.DEVICE) for t in next(gpt.batches(gpt.tokens(), 2, gpt.TINY.seq_len, 1)))
    la, lb = a(x, y)[1], b(x, y)[1]
    la.backward()
    lb.backward()
    # float32 on the CPU; on a GPU, tl.dot and cuBLAS may round float32 products through TF32
    atol, rtol = cu.pick(gpu=(2e-3, 2e-2), cpu=(1e-5, 1e-3))
    check.compare("loss", lb, la.detach().double(), atol=atol, rtol=rtol)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        check.compare(f"gradient of {name}", pb.grad, pa.grad.double(), atol=atol, rtol=rtol)


@pytest.mark.slow
def test_losses_agree_over_training_steps():
    a, b = gpt.twins(gpt.TINY, cu.DEVICE)
    data = gpt.tokens()
    la = gpt.train(a, data, steps=3, batch=2, progress=False, lr=1e-3)
    lb = gpt.train(b, data, steps=3, batch=2, progress=False, lr=1e-3)
    assert la[-1] < la[0]
    assert max(abs(p - q) / p for p, q in zip(la, lb)) < 1e-4


def test_sequence_longer_than_the_model_is_refused():
    m = gpt.GPT(gpt.TINY)
    with pytest.raises(ValueError, match="longer than the model"):
        m(torch.zeros(1, gpt.TINY.seq_len + 1, dtype=torch.int64))


def _decode_matches_full_forward(model, idx, prompt):
    full = model(idx)
    cache = gpt.KVCache(model.cfg, idx.shape[0])
    rows = [model(idx[:, :prompt], cache=cache)[:, -1]]
    rows += [model(idx[:, j:j + 1], cache=cache)[:, -1] for j in range(prompt, idx.shape[1])]
    assert cache.length == idx.shape[1]
    check.compare(f"{model.ops.name}: decoded logits", torch.stack(rows, 1), full[:, prompt - 1:].double(),
                  atol=1e-5, rtol=1e-4)


def test_kv_cache_decoding_gives_the_full_forwards_logits():
    a, b = gpt.twins(gpt.TINY, cu.DEVICE)
    idx = next(gpt.batches(gpt.tokens(), 2, gpt.TINY.seq_len, 1, seed=4))[0][:1, :9].to(cu.DEVICE)
    with torch.no_grad():
        for model in (a, b):  # one query row against every cached key: causal aligned bottom-right
            _decode_matches_full_forward(model, idx, 6)


def test_generate_is_reproducible_and_refuses_too_long():
    model = gpt.GPT(gpt.TINY).to(cu.DEVICE)
    first, again = gpt.generate(model, "ab", 6, seed=3), gpt.generate(model, "ab", 6, seed=3)
    assert first == again and isinstance(first, str)
    with pytest.raises(ValueError, match="exceed seq_len"):
        gpt.generate(model, "x" * 30, 10)
    with pytest.raises(ValueError, match="temperature"):
        gpt.generate(model, "ab", 2, temperature=0.0)
    cache = gpt.KVCache(gpt.TINY, 1)
    cache.length = gpt.TINY.seq_len
    with pytest.raises(ValueError, match="longer than the model"):
        model(torch.zeros(1, 1, dtype=torch.int64, device=cu.DEVICE), cache=cache)


def test_model_flops_counts_every_parameter_but_the_position_embeddings():
    m = gpt.GPT(gpt.TINY)
    f = gpt.model_flops(gpt.TINY, batch=3)
    assert f["params"] == sum(p.numel() for p in m.parameters()) - m.wpe.weight.numel()
    cfg = gpt.TINY
    assert f["tokens"] == 3 * cfg.seq_len
    assert f["flops"] == (6 * f["params"] + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len) * f["tokens"]


def test_mfu_divides_by_the_datasheets_dense_bf16_peak():
    from course_utils import hardware
    h100 = hardware.lookup("NVIDIA H100 80GB HBM3")        # the name an H100 SXM reports
    assert h100.peak_tflops("bfloat16") == 989              # dense (half the sparse figure), as llm.c divides by
    f = gpt.model_flops(gpt.GPU, batch=8)
    assert f["params"] == 42_725_376 and f["flops"] == (6 * 42_725_376 + 12 * 6 * 768 * 1024) * 8 * 1024


def test_optimizer_is_adamw_fused_on_a_gpu_only():
    opt = gpt.optimizer(gpt.GPT(gpt.TINY))
    assert isinstance(opt, torch.optim.AdamW) and not opt.defaults["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU")
def test_optimizer_is_fused_on_the_gpu():
    opt = gpt.optimizer(gpt.GPT(gpt.TINY).cuda(), capturable=True)
    assert opt.defaults["fused"] and opt.defaults["capturable"]


@pytest.mark.slow
def test_course_model_traces_whole_under_torch_compile():
    torch._dynamo.reset()
    model = gpt.GPT(gpt.TINY).to(cu.DEVICE).use("course")
    x, y = (t.to(cu.DEVICE) for t in next(gpt.batches(gpt.tokens(), 1, 16, 1)))
    eager = model(x, y)[1]
    compiled = torch.compile(model, fullgraph=True, backend="eager")(x, y)[1]  # Dynamo raises on a graph break
    check.compare("compiled loss", compiled, eager.detach().double(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ the training benchmark's judging


@pytest.fixture
def training_bench():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import training
    return training


@pytest.mark.machinery   # a tool around the kernels: their own tests run them under the newest Triton
def test_losses_are_judged_step_by_step_and_a_divergent_step_replayed(training_bench, monkeypatch):
    original = gpt.twins

    def twins(cfg, device, seed=0, bf16=None):  # torch ops twice, the second one's weights nudged: its loss differs
        a, b = original(cfg, device, seed, bf16=False)
        with torch.no_grad():
            b.wte.weight.mul_(30.0)
        return a, b.use("torch")
    monkeypatch.setattr(gpt, "twins", twins)
    curve, report = training_bench.losses(2, gpt.TINY, gpt.tokens(), device=cu.DEVICE, floor=False)
    assert list(curve.columns) == ["step", "torch_ops", "course_ops", "rel_diff", "signed_rel_diff"] and len(curve) == 2
    assert (curve["rel_diff"] > training_bench.LOSS_TOLERANCE).iloc[0]
    assert set(report["step"]) == {0} and set(report["version"]) == {"torch", "course"}
    assert {"blocks.0.proj", "blocks.1.out", "logits", "loss"} <= set(report["output"])
    err = report["rel_err_vs_fp32"]
    if cu.on_gpu():   # bf16 autocast against the float32 twin: rounding is found, and every error is finite
        assert err.notna().all() and (err > 0).all() and (err < float("inf")).all()
    else:
        assert (err < 1e-6).all()  # on the CPU both run in float32: no rounding to find


def test_targets_are_the_issues_ratios(training_bench, monkeypatch):
    import pandas as pd
    monkeypatch.setattr(training_bench.bench, "recorded", lambda name, gpu=None: None)   # no recorded overhead table
    rows = {"eager": (18.0, 10.0, 5.0), "torch.compile": (14.0, 9.0, 4.5), "course": (15.0, 7.5, 4.0),
            "course, one autograd node the model": (13.5, None, None),
            "course, step by hand": (12.0, None, None), "course, step by hand + torch.compile": (11.0, None, None),
            "course + torch.compile": (13.0, 7.0, 4.0),
            "eager + CUDA graph": (11.0, None, None),
            "course + CUDA graph": (8.0, None, None), "torch.compile reduce-overhead": (9.0, None, None),
            "course + torch.compile reduce-overhead": (8.5, None, None)}
    one = pd.DataFrame([{"impl": k, "ms": ms, "gpu_busy_ms": busy, "peak_alone_gib": peak}
                        for k, (ms, busy, peak) in rows.items()])
    df = pd.concat([one.assign(config_key=key, config=key, judged=judged)
                    for key, judged in (("gpt2-b8", True), ("toy-b8", False))], ignore_index=True)
    df = df.assign(loss_max_rel_diff=0.01, loss_steps=200, loss_course_mean_abs=0.004, loss_course_mean_signed=-0.002,
                   loss_torch_seed1_mean_abs=0.006, loss_torch_seed1_max=0.03, loss_torch_compile_mean_abs=0.005,
                   loss_torch_compile_max=0.04)
    targets = training_bench.targets(df)
    assert [round(t.measured, 4) for t in targets] == [
        round(14 / 13.5, 4), round(18 / 13.5, 4), round(14 / 12, 4), round(18 / 12, 4), round(9 / 8, 4),
        round(14 / 13, 4), round(14 / 11, 4), round(9 / 8.5, 4), round(9 / 7.5, 4), round(4.5 / 4, 4), 4.0, 1.5,
        3.0]
    assert [t.required for t in targets] == [1.0, 1.3, 1.0, 1.3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # the floor is the larger torch-against-torch difference (compile's largest step, seed 1's mean), named
    assert "torch_compile" in targets[10].claim and "torch_seed1" in targets[11].claim
    assert all(t.claim.startswith("gpt2-b8") for t in targets[:10])   # the toy row is recorded, never judged
    old = pd.DataFrame([{"impl": "eager", "ms": 14.5}])  # the earlier capstone's file: nothing is invented
    assert all(t.measured != t.measured for t in training_bench.targets(old)[:10])


def test_host_targets_add_the_autograd_floor_when_the_table_has_it(training_bench, monkeypatch):
    """The per-op host targets: 1.5x (aten + the floor's extra) / course's when the recorded table has the floor
    row, else 1.5x aten / course's (a table from before the floor); the floor rows are never targets."""
    import pandas as pd

    from course_utils.ops import overhead as O
    rows = [dict(op="layer_norm", course_us=40.0, aten_us=10.0, course_fwd_bwd_us=300.0, aten_fwd_bwd_us=100.0),
            dict(op=O.FLOOR_ROW, course_us=20.0, aten_us=8.0, course_fwd_bwd_us=200.0, aten_fwd_bwd_us=100.0)]
    table = pd.DataFrame(rows)
    table["course_over_aten"] = [4.0, 2.5]
    monkeypatch.setattr(training_bench.bench, "recorded", lambda name, gpu=None: table)
    (t,) = training_bench._host_targets()
    assert "floor's extra" in t.claim and t.measured == pytest.approx(1.5 / max(40 / 22, 300 / 200))
    monkeypatch.setattr(training_bench.bench, "recorded", lambda name, gpu=None: table.iloc[[0]])
    (t,) = training_bench._host_targets()
    assert "(course <= 1.5x aten)" in t.claim and t.measured == pytest.approx(1.5 / 4.0)


def test_loss_agreement_compares_the_course_with_the_noise_floor(training_bench):
    import pandas as pd
    steps = pd.Series(range(10))
    curve = pd.DataFrame({"step": steps, "rel_diff": [0.05] * 5 + [0.01] * 5,
                          "signed_rel_diff": [0.05] * 5 + [0.01] * 5,
                          "torch_seed1_rel_diff": [0.02] * 10, "torch_seed1_signed_rel_diff": [0.02, -0.02] * 5})
    got = training_bench.loss_agreement(curve)
    assert got["course_max"] == 0.05 and abs(got["course_mean_abs"] - 0.01) < 1e-12     # the last half only
    assert abs(got["course_mean_signed"] - 0.01) < 1e-12 and abs(got["torch_seed1_mean_signed"]) < 0.01


def test_the_fusion_ladder_takes_each_op_from_the_library_or_chapter_11():
    chapter11 = registry.course_ops(library=())
    assert chapter11.add_layer_norm is registry._add_then_layer_norm
    assert chapter11.cross_entropy is registry._torch_cross_entropy
    one = registry.course_ops(library=("add_layer_norm",))
    from course_utils import ops
    assert one.add_layer_norm is ops.add_layer_norm and one.layer_norm is not ops.layer_norm
    with pytest.raises(ValueError, match="unknown op"):
        registry.course_ops(library=("softmax",))


@pytest.mark.gpu
@pytest.mark.skipif(not cu.on_gpu(), reason="needs a CUDA GPU")
def test_course_model_compiles_with_inductor_and_graphs_on_the_gpu():
    torch._dynamo.reset()
    x, y = (t.cuda() for t in next(gpt.batches(gpt.tokens(), 2, gpt.TINY.seq_len, 1)))
    eager = gpt.GPT(gpt.TINY).cuda().use("course")
    compiled = torch.compile(gpt.GPT(gpt.TINY).cuda().use("course"), fullgraph=True)
    with gpt._autocast(x.device):
        want, got = float(eager(x, y)[1]), float(compiled(x, y)[1])
    assert abs(got - want) / want < 1e-2
    replay, loss = gpt.graphed_step(gpt.GPT(gpt.TINY).cuda().use("course"), x, y)
    replay()   # the capture ran nothing: the loss holds a value once the graph has been replayed
    first = float(loss)
    replay()
    assert float(loss) < first  # the graph holds the optimizer: each replay trains one more step on the batch


def test_bf16_weights_keep_the_exact_float32_masters_for_the_optimizer():
    """llm.c's mixed precision: the model's weights become bf16 (no autocast then) and the optimizer keeps
    the float32 values they came from as its masters, in one fused AdamW (MasterAdamW)."""
    from course_utils.tuned.adamw import MasterAdamW
    model = gpt.GPT(gpt.TINY).to(cu.DEVICE)
    fp32 = [p.detach().clone() for p in model.parameters()]
    assert gpt.uses_autocast(model)
    gpt.bf16_weights(model)
    assert not gpt.uses_autocast(model) and all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt = gpt.optimizer(model)
    assert isinstance(opt, MasterAdamW)
    for master, want, p in zip(opt.masters(), fp32, model.parameters()):
        assert torch.equal(master, want) and torch.equal(p, want.to(torch.bfloat16))


def test_a_float32_residual_stream_under_16_bit_weights():
    """``residual_dtype=float32`` keeps the stream wider than the weights: the course's step then sums the
    residual in float32 (add_layer_norm's s) while every GEMM reads 16-bit activations; its loss and a
    16-bit stream's both stay near the float32 model's (float16 here: the interpreter's bf16 is wrong)."""
    base = gpt.GPT(gpt.TINY).to(cu.DEVICE).use("course")
    x, y = (t.to(cu.DEVICE) for t in next(gpt.batches(gpt.tokens(), 2, gpt.TINY.seq_len, 1)))
    want = float(base(x, y)[1])
    seen = []
    for residual in (None, torch.float32):
        m = copy.deepcopy(base).half()
        m.residual_dtype = residual
        hook = m.blocks[0].qkv.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].dtype))
        loss = float(m(x, y)[1])
        hook.remove()
        assert abs(loss - want) / want < 2e-2, (residual, loss, want)
    assert seen == [torch.float16, torch.float16]   # the GEMMs read 16-bit activations either way


def test_a_call_without_the_losses_keeps_the_recorded_loss_columns(training_bench, monkeypatch):
    # a call that re-times the versions alone (COURSE_TRAINING_PARTS=versions) keeps the headline's recorded
    # loss columns and says which day's curve they come from; nothing is invented where none are recorded
    import pandas as pd
    head = training_bench.HEADLINE
    rec = pd.DataFrame([{"config_key": head, "impl": "eager", "date": "2026-11-25", "loss_steps": 200,
                         "loss_course_mean_abs": 0.004}, {"config_key": "toy-b8", "impl": "eager", "loss_steps": 9}])
    monkeypatch.setattr(training_bench.bench, "recorded", lambda name, gpu=None: rec)
    assert training_bench._recorded_losses() == {"loss_steps": 200, "loss_course_mean_abs": 0.004,
                                                 "loss_date": "2026-11-25"}
    monkeypatch.setattr(training_bench.bench, "recorded", lambda name, gpu=None: rec.drop(columns=["loss_steps",
                                                                                        "loss_course_mean_abs"]))
    assert training_bench._recorded_losses() == {}
    monkeypatch.setattr(training_bench.bench, "recorded", lambda name, gpu=None: None)
    assert training_bench._recorded_losses() == {}


def test_a_losses_only_call_writes_its_date_into_a_recorded_table_without_one(training_bench):
    # an H200 table recorded with no loss curve reads loss_date as an all-empty float column: a later call that
    # records only the losses (COURSE_TRAINING_PARTS=losses) still writes its day there (it raised TypeError)
    import pandas as pd
    head = training_bench.HEADLINE
    rec = pd.DataFrame([{"config_key": head, "impl": "eager", "loss_date": float("nan"), "loss_steps": float("nan")},
                        {"config_key": "toy-b8", "impl": "eager", "loss_date": float("nan"),
                         "loss_steps": float("nan")}])
    got = training_bench.with_headline(rec, {"loss_date": "2026-11-30", "loss_steps": 200})
    assert list(got["loss_date"].iloc[:1]) == ["2026-11-30"] and pd.isna(got["loss_date"].iloc[1])
    assert got["loss_steps"].iloc[0] == 200 and pd.isna(got["loss_steps"].iloc[1])


def test_a_run_on_one_gpu_never_reads_another_gpus_records(training_bench, monkeypatch, tmp_path):
    """An H200's first training run, with only the H100's files recorded: its rows are not merged with the
    H100's, its losses are not the H100's, and judging the H200's table reads the H200's overhead table."""
    import pandas as pd

    from course_utils import results
    h100 = tmp_path / "h100-80gb-hbm3"
    h100.mkdir()
    pd.DataFrame([{"config_key": k, "impl": "eager", "gpu": "NVIDIA H100 80GB HBM3", "loss_steps": 200}
                  for k in ("gpt2-b8", "gpt2-b16")]).to_csv(h100 / "training.csv", index=False)
    pd.DataFrame([{"op": "layer_norm", "course_us": 40.0, "aten_us": 10.0, "course_over_aten": 4.0}]).to_csv(
        h100 / "training_overhead.csv", index=False)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(training_bench.bench, "gpu_slug", lambda name=None: results.gpu_slug(name or "NVIDIA H200"))
    mine = pd.DataFrame([{"config_key": "gpt2-b16", "impl": "eager"}])
    merged = training_bench._merge_recorded(mine, "training", ["gpt2-b16"])
    assert list(merged["config_key"]) == ["gpt2-b16"]          # the H100's gpt2-b8 row is not taken in
    assert training_bench._recorded_losses() == {}
    h200_table = pd.DataFrame([{"config_key": "gpt2-b8", "gpu": "NVIDIA H200"}])
    assert training_bench._host_targets(h200_table) == []     # the H200 has no overhead table yet
    h100_table = pd.DataFrame([{"config_key": "gpt2-b8", "gpu": "NVIDIA H100 80GB HBM3"}])
    (t,) = training_bench._host_targets(h100_table)           # judging the H100's record reads the H100's
    assert t.measured == pytest.approx(1.5 / 4.0)
