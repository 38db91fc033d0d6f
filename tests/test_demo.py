import argparse
import gc
import math
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8train import Float8Linear, Float8LinearConfig
from fp8train.__main__ import main
from fp8train.data import (
    VOCAB_SIZE,
    batches,
    eval_batches,
    load_text,
    load_text_tokens,
    stdlib_sources,
    train_val_split,
)
from fp8train.demo import (
    add_demo_arguments,
    lr_at,
    run_demo,
    saved_activation_bytes,
    speed_note,
    to_float8,
)
from fp8train.filters import CostModel
from fp8train.models import ModelArgs, Transformer

# Small enough that both runs take about a second on two CPU cores. fp32: CPU bf16 is slow.
TINY = [
    "--steps", "6", "--dim", "32", "--n-layers", "1", "--batch-size", "2", "--seq-len", "16",
    "--eval-batches", "2", "--device", "cpu", "--dtype", "float32", "--quiet",
]  # fmt: skip


def demo_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    return parser.parse_args(argv)


def test_main_demo_prints_table_of_both_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY]) == 0
    out = capsys.readouterr().out
    assert "fp8train" in out and "torch" in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| run | dtype |") and "saved activations MiB" in table[0]
    assert [line.split(" | ")[0] for line in table[1:]] == ["| high precision", "| float8"]


def _replace(argv: list[str], option: str, value: str) -> list[str]:
    argv = list(argv)
    if option in argv:
        argv[argv.index(option) + 1] = value
    else:
        argv += [option, value]
    return argv


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("--steps", "3", "--steps 3: give more than 3"),
        ("--batch-size", "0", "--batch-size 0: give a positive number"),
        ("--dim", "40", "--dim 40 is not a multiple of 16, which float8 gemms need: give 48"),
        ("--seq-len", "15", "2 x --seq-len 15 = 30 tokens a step, not a multiple of 16"),
        ("--lr", "nan", "--lr nan: give a positive learning rate"),
        ("--device", "nodevice", "--device nodevice cannot be used here"),
        ("--device", "cuda:99", "--device cuda:99 cannot be used here"),
        ("--device", "meta", "--device meta cannot be used here .meta tensors hold no data"),
        ("--dtype", "float16", "--dtype float16: AdamW cannot train float16 parameters"),
        ("--seq-len", "100000", r"--seq-len 100000 \+ 1\) tokens a batch is more than the"),
    ],
)
def test_demo_refuses_settings_it_cannot_run_naming_the_option(option, value, match):
    with pytest.raises(SystemExit, match=match):
        main(["demo", *_replace(TINY, option, value)])


@pytest.mark.parametrize("dim", [16, 48, 1040, 4096])
def test_demo_heads_divide_any_dim_of_16s_into_even_head_dims(dim):
    from fp8train.demo import demo_heads

    heads = demo_heads(dim)
    assert heads >= 4 and dim % heads == 0 and (dim // heads) % 2 == 0
    ModelArgs(dim=dim, n_heads=heads)  # its own checks pass


def test_demo_stats_prints_the_casts_of_every_float8_layer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", *TINY, "--stats"]) == 0
    out = capsys.readouterr().out
    assert "float8 casts of one step" in out
    assert "| layers.0.feed_forward.w2 | grad_output | grad_input | e5m2 |" in out


def test_run_demo_rows() -> None:
    rows = run_demo(demo_args(TINY))
    assert [row["run"] for row in rows] == ["high precision", "float8"]
    for row in rows:
        assert len(row["losses"]) == 6
        assert all(math.isfinite(x) for x in row["losses"])
        assert math.isfinite(row["val_loss"]) and row["step_ms"] > 0
        assert row["saved_activations_mib"] > 0 and row["peak_memory_mib"] is None
    hp, fp8 = rows
    # Same weights, same first batch: the first losses agree up to float8 error.
    assert fp8["losses"][0] == pytest.approx(hp["losses"][0], rel=1e-2)
    assert hp["float8_linears"] == 0 and hp["gap_pct"] is None
    assert fp8["float8_linears"] == 7  # 4 attention + 3 feed-forward; not the lm_head
    assert math.isfinite(fp8["gap_pct"])


def test_demo_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    assert lr_at(0, 300, 1e-3) == pytest.approx(1e-3 / 15)  # warm-up: 5% of the steps
    assert lr_at(14, 300, 1e-3) == pytest.approx(1e-3)
    assert lr_at(15, 300, 1e-3) == pytest.approx(1e-3)  # the cosine, from the top
    assert lr_at(299, 300, 1e-3) == pytest.approx(1e-4, rel=1e-3)
    assert lr_at(0, 300, 1e-3, warmup_steps=30) == pytest.approx(1e-3 / 30)
    assert lr_at(0, 5, 1.0) == pytest.approx(1.0)  # at least one warm-up step
    lrs = [lr_at(step, 300, 1e-3) for step in range(15, 300)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_demo_clips_each_steps_gradients_and_sets_its_learning_rate(monkeypatch) -> None:
    clipped, lrs = [], []
    clip = torch.nn.utils.clip_grad_norm_
    step = torch.optim.AdamW.step

    def recording_clip(params, max_norm, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        clipped.append(max_norm)
        return clip(params, max_norm, *args, **kwargs)

    def recording_step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        lrs.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    args = demo_args(TINY)
    run_demo(args)
    steps = len(lrs) // 2
    assert clipped == [1.0] * len(lrs) and steps == 6
    assert lrs[:steps] == lrs[steps:] == [lr_at(i, steps, args.lr) for i in range(steps)]


def test_to_float8_keeps_lm_head() -> None:
    model = to_float8(Transformer(ModelArgs(dim=32, n_layers=1)), demo_args(["--device", "cpu"]))
    assert not isinstance(model.lm_head, Float8Linear)
    assert isinstance(model.layers[0].attention.wq, Float8Linear)
    assert isinstance(model.layers[0].feed_forward.w2, Float8Linear)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--help"], ["demo"]),
        (["demo", "--help"], ["--steps", "--recompute-weight-cast", "--no-recompute-input-cast",
                              "--emulate", "--compile", "--dtype", "--eval-batches"]),
    ],
)  # fmt: skip
def test_help(argv: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in expected:
        assert word in out


def test_tokens_and_split() -> None:
    tokens = load_text_tokens()
    assert tokens.dtype == torch.long and tokens.ndim == 1 and len(tokens) > 100_000
    assert 0 <= tokens.min() and tokens.max() < VOCAB_SIZE
    train, val = train_val_split(tokens)
    assert len(val) == pytest.approx(0.1 * len(tokens), abs=1)
    assert torch.equal(torch.cat([train, val]), tokens)
    assert torch.equal(load_text_tokens(), tokens)


def test_stdlib_corpus_is_the_docs_then_the_standard_librarys_sources() -> None:
    docs, stdlib = load_text_tokens("docs"), load_text_tokens("stdlib")
    assert torch.equal(stdlib[: len(docs)], docs)
    # Big enough that the end-to-end preset (300 steps of 8k tokens) stays within one pass.
    assert len(stdlib) > 5_000_000 and len(stdlib) > 10 * len(docs)
    sources = stdlib_sources()
    names = {p.name for p in sources}
    assert {"argparse.py", "dataclasses.py"} <= names
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = [p.relative_to(root) for p in sources]
    assert not any({"test", "tests", "site-packages"} & set(p.parts) for p in relative)
    assert [p.as_posix() for p in relative] == sorted(p.as_posix() for p in relative)


def test_an_unknown_corpus_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"corpus='wiki' is not one of \('docs', 'stdlib'\)"):
        load_text_tokens("wiki")


def test_stdlib_corpus_without_sources_says_to_use_docs(monkeypatch: pytest.MonkeyPatch) -> None:
    import fp8train.data

    monkeypatch.setattr(fp8train.data, "stdlib_sources", lambda: [])
    with pytest.raises(RuntimeError, match="use corpus='docs'"):
        load_text_tokens("stdlib")


def test_text_falls_back_to_stdlib_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # makes the import fail
    text = load_text()
    assert len(text) > 100_000 and "def " in text


def test_batches_are_deterministic_and_shifted() -> None:
    tokens = load_text_tokens()
    first = batches(tokens, 4, 32, torch.Generator().manual_seed(1))
    second = batches(tokens, 4, 32, torch.Generator().manual_seed(1))
    for _ in range(3):
        (x1, y1), (x2, y2) = next(first), next(second)
        assert x1.shape == y1.shape == (4, 32)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(x1[:, 1:], y1[:, :-1])
    other = next(batches(tokens, 4, 32, torch.Generator().manual_seed(2)))
    assert not torch.equal(other[0], x1)

    val = eval_batches(tokens, 4, 32, 3)
    assert len(val) == 3 and all(x.shape == y.shape == (4, 32) for x, y in val)
    again = eval_batches(tokens, 4, 32, 3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(val, again, strict=True))


def test_model_forward_shape_init_and_causality() -> None:
    args = ModelArgs()
    torch.manual_seed(0)
    model = Transformer(args)
    torch.manual_seed(0)
    twin = Transformer(args)
    for (name, p), q in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    for module in model.modules():
        if isinstance(module, nn.Linear):
            assert module.bias is None
            assert module.in_features % 16 == 0 and module.out_features % 16 == 0

    tokens = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, args.vocab_size)
    # Changing the last token must not change the logits of earlier positions.
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % args.vocab_size
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])


@pytest.mark.parametrize("float8", [False, True], ids=["hp", "float8"])
def test_counting_saved_activations_frees_them(float8: bool) -> None:
    """The count runs a forward and must leave nothing of it alive: the demo's second run would
    otherwise carry the first run's activations in its peak memory."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=32))
    if float8:
        model = to_float8(model, argparse.Namespace(emulate=False, recompute_weight_cast=True,
                                                    recompute_input_cast=None))  # fmt: skip
    tokens = torch.randint(0, 256, (4, 33))

    def graph_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o) and o.grad_fn is not None)

    before = graph_tensors()
    assert saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:]) > 0
    assert graph_tensors() == before


def test_counting_saved_activations_counts_each_saved_storage_once() -> None:
    """Exact on a model whose saves are known, among them tensors that the forward drops as it
    goes: a dropped storage's address, reused by the next tensor, must not make the count skip
    that tensor as already seen."""

    class Relus(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = torch.nn.Linear(64, 256)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = torch.nn.functional.one_hot(tokens, 64).float().requires_grad_()
            for _ in range(4):
                x = torch.relu(x * 1.0)  # relu saves its output; the previous one is dropped
            return self.head(x)  # saves its input: the last relu's output, the same storage

    tokens = torch.randint(0, 64, (4, 16))
    counts = {saved_activation_bytes(Relus(), tokens, tokens) for _ in range(3)}
    # 4 relu outputs, fp32; the loss's log-softmax output, fp32, its targets, int64, and its
    # total weight, one fp32 (the fp32 logits' .float() is the logits themselves).
    expected = 4 * (4 * 16 * 64 * 4) + 4 * 16 * 256 * 4 + 4 * 16 * 8 + 4
    assert counts == {expected}


@pytest.mark.parametrize("faster", [True, False])
def test_speed_note_on_the_cpu_says_float8_speed_is_a_gpus(faster: bool) -> None:
    rows = [{"tokens_per_s": 100.0}, {"tokens_per_s": 150.0 if faster else 50.0}]
    model = Transformer(ModelArgs(dim=32, n_layers=1))
    note = speed_note(rows, model, torch.device("cpu"), 32, compiled=False)
    if faster:
        assert note is None
    else:
        assert "the CPU has no fast float8 gemms" in note


@pytest.mark.parametrize("compiled", [False, True])
def test_speed_note_on_a_gpu_counts_the_layers_the_cost_model_expects_to_pay(
    compiled: bool,
) -> None:
    """The cost model's count, over the layers the demo converts (not the lm_head): at 8192
    tokens an FFN layer of 4096 x 14336 pays in either mode, a 1024 x 1024 layer in neither
    (fp8train.auto_filter, with the eager host time of a host before the eager fast path).
    No GPU needed: the model is on the meta device."""
    model = nn.ModuleDict(
        {
            "w1": nn.Linear(4096, 14336, device="meta"),
            "wq": nn.Linear(1024, 1024, device="meta"),
            "lm_head": nn.Linear(4096, 14336, device="meta"),
        }
    )
    rows = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}]
    note = speed_note(rows, model, torch.device("cuda"), 8192, compiled=compiled, costs=CostModel())
    mode = "compiled" if compiled else "eager"
    assert f"expects {mode} float8 to be faster in 1 of these 2 layers" in note
    assert ("--compile" in note) is not compiled


def test_speed_note_eager_measures_this_hosts_time_per_layer(monkeypatch) -> None:
    """Eager, the note's cost model takes the host time it measures (CostModel.measure_host),
    with the demo's float8 config: a fast host keeps the thin 1024 x 8192 layer."""
    calls = []

    def measure_host(device, config=None):
        calls.append((device, config))
        return CostModel(eager_cpu_s=0.2e-3)

    monkeypatch.setattr(CostModel, "measure_host", measure_host)
    model = nn.ModuleDict({"wo": nn.Linear(1024, 8192, device="meta")})
    rows = [{"tokens_per_s": 100.0}, {"tokens_per_s": 50.0}]
    config = Float8LinearConfig(recompute_weight_cast=False)
    note = speed_note(rows, model, torch.device("cuda"), 16384, False, config)
    assert calls == [(torch.device("cuda"), config)]
    assert "expects eager float8 to be faster in 1 of these 1 layers" in note
