"""The drafter's packed training step: windows packed into one sequence attend only inside themselves, the
chunked soft cross-entropy equals the autograd form, the FLOPs formula equals a counted forward and backward,
and a training step reads nothing back from the device."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from eagle3_assets.stages.eagle3_drafter.data import Teacher, plan_steps, plan_windows
from eagle3_assets.stages.eagle3_drafter.loss import soft_cross_entropy
from eagle3_assets.stages.eagle3_drafter.model import (
    DocLayout,
    DrafterConfig,
    Eagle3Drafter,
    QueryRows,
    loss_rows,
    train_flops_per_token,
    ttt_attention,
)
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings, train

LENGTHS = [7, 1, 12, 7, 3, 12, 2]


def tiny_drafter(vocab=300, draft=40, H=32, dtype=torch.float64) -> Eagle3Drafter:
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=vocab,
        draft_vocab_size=draft,
    )
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, torch.randn(vocab, H), torch.arange(0, 2 * draft, 2)).to(dtype)


def written_out_packed(q, k0, v0, chain_k, chain_v, scale, lengths):
    """Every score materialized: query t sees the step-0 keys of its own document at positions <= t, and
    chain_k[i][t] for each i."""
    h, L, d = q.shape
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    t = torch.arange(L)
    allowed = (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])
    scores = torch.einsum("htd,hsd->hts", q, k0) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    chain = [(q * k).sum(-1, keepdim=True) * scale for k in chain_k]
    p = torch.softmax(torch.cat([scores, *chain], -1), -1)
    out = p[..., :L] @ v0
    for i, v in enumerate(chain_v):
        out = out + p[..., L + i : L + i + 1] * v
    return out


STARTS = [2, 1, 0, 7, 3, 11, 0]  # per document of LENGTHS: the first row steps >= 1 run over (its length: none)


def test_ttt_attention_over_query_rows_equals_the_written_out_mask_on_those_rows_and_its_gradients():
    """Steps >= 1 over some rows only (`QueryRows`): what the written-out attention gives those rows when every
    row is a query, gradients included, whether the rows' documents are alone, grouped or all in one group."""
    g = torch.Generator().manual_seed(7)
    h, d, scale = 3, 8, 8**-0.5
    L = sum(LENGTHS)
    for waste in (1.0, 2.0, 100.0):
        rows = QueryRows(LENGTHS, STARTS, waste=waste)
        index = rows.index
        assert len(rows) == sum(n - a for n, a in zip(LENGTHS, STARTS, strict=True)) == len(index)
        for steps in (1, 3):
            k0, v0 = (torch.randn(h, L, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
            q = torch.randn(h, len(rows), d, generator=g, dtype=torch.float64, requires_grad=True)
            chain_k = [torch.randn(h, len(rows), d, generator=g, dtype=torch.float64) for _ in range(steps)]
            chain_v = [torch.randn(h, len(rows), d, generator=g, dtype=torch.float64) for _ in range(steps)]
            for x in (*chain_k, *chain_v):
                x.requires_grad_(True)
            leaves = [q, k0, v0, *chain_k, *chain_v]
            got = ttt_attention(q, k0, v0, chain_k, chain_v, scale, DocLayout(LENGTHS, waste=waste), rows)

            def everywhere(x, index=index):  # the rows' tensor at full length (other rows' queries are never read)
                return torch.zeros(h, L, d, dtype=x.dtype).index_copy(1, index, x)

            want = written_out_packed(
                everywhere(q),
                k0,
                v0,
                [everywhere(c) for c in chain_k],
                [everywhere(c) for c in chain_v],
                scale,
                LENGTHS,
            )[:, index]
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
            w = torch.randn(h, len(rows), d, generator=g, dtype=torch.float64)
            for a, b in zip(
                torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves), strict=True
            ):
                torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_loss_rows_hold_every_row_a_later_steps_loss_reads_and_start_at_one():
    """A row of a document is needed by TTT step k >= 1 when token t+2+k is a completion token; `loss_rows` keeps
    each document's suffix from its first needed row, and nothing for a document whose steps >= 1 read no row."""
    g = torch.Generator().manual_seed(3)
    for steps in (2, 3, 7):
        for trial in range(20):
            mask = (torch.rand(sum(LENGTHS), generator=g) < 0.15 * (trial % 4)).long()
            rows = loss_rows(LENGTHS, mask, steps)
            kept = set(rows.index.tolist()) if rows is not None else set(range(sum(LENGTHS)))
            offset = 0
            for n in LENGTHS:
                needed = [
                    t for t in range(n) if any(t + 2 + k < n and mask[offset + t + 2 + k] == 1 for k in range(1, steps))
                ]
                mine = sorted(r - offset for r in kept if offset <= r < offset + n)
                assert set(needed) <= set(mine), (steps, trial, n)
                if rows is not None:
                    assert mine == (list(range(needed[0], n)) if needed else []), (steps, trial, n, needed, mine)
                offset += n
    assert loss_rows(LENGTHS, torch.ones(sum(LENGTHS), dtype=torch.long), 1) is None  # no step >= 1


def test_a_drafter_unrolled_over_the_loss_rows_gives_those_rows_the_logits_of_a_full_unroll():
    model = tiny_drafter()
    g = torch.Generator().manual_seed(4)
    L, steps = sum(LENGTHS), 4
    aux = torch.randn(L, 96, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 300, (L,), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    layout = DocLayout(LENGTHS, waste=2.0)
    rows = QueryRows(LENGTHS, STARTS, waste=2.0)
    full = model.unroll(aux, tokens, positions, steps, layout)
    pruned = model.unroll(aux, tokens, positions, steps, layout, rows)
    torch.testing.assert_close(pruned[0], full[0], rtol=0, atol=0)  # step 0 runs over every row as before
    for k in range(1, steps):
        torch.testing.assert_close(pruned[k], full[k][rows.index], rtol=1e-9, atol=1e-9)


def test_packed_ttt_attention_equals_a_written_out_document_mask_and_its_gradients():
    g = torch.Generator().manual_seed(5)
    h, d, scale = 3, 8, 8**-0.5
    L = sum(LENGTHS)
    for waste in (1.0, 2.0, 100.0):  # every document alone, some grouped, all in one padded group
        layout = DocLayout(LENGTHS, waste=waste)
        for steps in (0, 1, 4):
            q, k0, v0 = (torch.randn(h, L, d, generator=g, dtype=torch.float64) for _ in range(3))
            chain_k = [torch.randn(h, L, d, generator=g, dtype=torch.float64) for _ in range(steps)]
            chain_v = [torch.randn(h, L, d, generator=g, dtype=torch.float64) for _ in range(steps)]
            leaves = [q, k0, v0, *chain_k, *chain_v]
            for x in leaves:
                x.requires_grad_(True)
            got = ttt_attention(q, k0, v0, chain_k, chain_v, scale, layout)
            want = written_out_packed(q, k0, v0, chain_k, chain_v, scale, LENGTHS)
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
            w = torch.randn(h, L, d, generator=g, dtype=torch.float64)
            for a, b in zip(  # a gradient per leaf
                torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves), strict=True
            ):
                torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    assert len(DocLayout(LENGTHS, waste=1.0).groups) == 5  # equal lengths share a call even without waste
    assert len(DocLayout(LENGTHS, waste=100.0).groups) == 1


def test_a_packed_unroll_equals_each_window_unrolled_alone():
    model = tiny_drafter()
    g = torch.Generator().manual_seed(2)
    L, steps = sum(LENGTHS), 4
    aux = torch.randn(L, 96, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 300, (L,), generator=g)
    positions = torch.cat([torch.arange(n) + 5 * i for i, n in enumerate(LENGTHS)])
    with torch.no_grad():
        packed = model.unroll(aux, tokens, positions, steps, DocLayout(LENGTHS, waste=2.0))
        a = 0
        for n in LENGTHS:
            alone = model.unroll(aux[a : a + n], tokens[a : a + n], positions[a : a + n], steps)
            for k in range(steps):
                torch.testing.assert_close(packed[k][a : a + n], alone[k], rtol=1e-9, atol=1e-9)
            a += n


def test_chunked_soft_cross_entropy_equals_the_autograd_form():
    g = torch.Generator().manual_seed(4)
    N, V = 37, 50
    target_p = torch.softmax(torch.randn(N + 3, V, generator=g, dtype=torch.float64) * 3, -1)
    rows = torch.randint(0, N + 3, (N,), generator=g)
    weight = torch.rand(N, generator=g, dtype=torch.float64) * (torch.rand(N, generator=g) > 0.3)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        z = (torch.randn(N, V, generator=g, dtype=torch.float64) * 4).to(dtype).requires_grad_(True)
        want = (weight * -(target_p[rows] * torch.log_softmax(z.double(), -1)).sum(-1)).sum()
        for chunk in (V, 7 * V, N * V, 10**9):  # one row per chunk, several, exactly all, more than all
            got = soft_cross_entropy(z, target_p, rows, weight, chunk_elements=chunk)
            torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
            (ga,) = torch.autograd.grad(got * 1.7, z)
            (gb,) = torch.autograd.grad(want * 1.7, z, retain_graph=True)
            torch.testing.assert_close(ga.double(), gb.double(), rtol=tol, atol=tol)


def test_the_reported_loss_is_fp32_under_bf16_autocast():
    """The training step runs the loss under bf16 autocast (CUDA's; CPU's lists the same op): the value the log and
    the metadata report stays fp32's, where autocast would compute the p . z term in bf16 (7.5e-6 off here)."""
    g = torch.Generator().manual_seed(5)
    N, V = 64, 4000
    z = torch.randn(N, V, generator=g) * 3
    target_p = torch.softmax(torch.randn(N, V, generator=g) * 3, -1)
    rows, weight = torch.arange(N), torch.ones(N)
    want = (weight.double() * -(target_p.double() * torch.log_softmax(z.double(), -1)).sum(-1)).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = soft_cross_entropy(z, target_p, rows, weight)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_flops_formula_equals_the_counted_matmuls_of_a_forward_and_backward():
    model = tiny_drafter(dtype=torch.float32)
    cfg, steps, L = model.cfg, 3, 29
    aux = torch.randn(L, 96)
    tokens = torch.randint(0, 300, (L,))
    counter = FlopCounterMode(display=False)
    with counter:
        logits = model.unroll(aux, tokens, torch.arange(L), steps)
        loss = sum(lg.sum() for lg in logits)
        assert isinstance(loss, torch.Tensor)  # not sum()'s start, 0: there are `steps` logits
        loss.backward()
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(v for op, v in counts.items() if "mm" in str(op))
    formula = train_flops_per_token(cfg, steps, L)
    assert matmuls == formula["linear"] * L
    # and the forward alone is a third of the non-fc work plus the fc once
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.unroll(aux, tokens, torch.arange(L), steps)
    forward = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    fc = 2 * 3 * cfg.target_hidden_size * cfg.hidden_size * L
    assert 3 * (forward - fc) + 2 * fc == matmuls
    assert formula["total"] > formula["linear"] > 0 and formula["attention"] > 0
    # steps >= 1 over the last 9 rows only (`loss_rows`): the formula at that share
    rows = QueryRows([L], [L - 9])
    counter = FlopCounterMode(display=False)
    with counter:
        loss = sum(lg.sum() for lg in model.unroll(aux, tokens, torch.arange(L), steps, DocLayout([L]), rows))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
    pruned = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert pruned == train_flops_per_token(cfg, steps, L, later_share=9 / L)["linear"] * L < matmuls


class ScalarReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (`.item()`, `float(t)`, `if t:` all land on
    `aten._local_scalar_dense`): on CUDA each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def synthetic_run(seed: int = 0):
    """A tiny drafter, samples of mixed lengths (cut into 48-token windows), the target's head."""
    model = tiny_drafter(dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    source = {}
    for i, n in enumerate([40, 13, 64, 25, 31, 50, 8, 64, 17, 29, 33, 60]):
        source[f"s{i}"] = {
            "input_ids": torch.randint(0, 300, (n,), generator=g, dtype=torch.int32),
            "loss_mask": (torch.arange(n) >= n // 3).to(torch.int8),
            "aux_hidden_states": torch.randn(n, 96, generator=g).bfloat16(),
            "final_hidden_state": torch.randn(n, 32, generator=g).bfloat16(),
        }
    windows = plan_windows([(k, len(v["input_ids"])) for k, v in source.items()], 48).windows
    head = torch.randn(300, 32, generator=g)
    settings = TrainSettings(ttt_steps=3, epochs=1, batch_tokens=100, max_len=48, checkpoint_every=0, warmup_steps=1)
    return model, source, windows, head, settings


def test_a_training_step_reads_nothing_back_from_the_device() -> None:
    model, source, windows, head, settings = synthetic_run()
    reads = ScalarReads()
    at_step: list[int] = []
    with reads:
        history = train(
            model,
            source,
            windows,
            [],
            settings,
            head=head,
            device=torch.device("cpu"),
            log=print,
            teacher=Teacher(head, model.draft_ids, torch.device("cpu")),
            on_step=lambda step, tokens: at_step.append(reads.count),
        )
    assert len(at_step) >= 5 and len(history.step_loss) == len(at_step) == len(history.grad_norm)
    per_step = [b - a for a, b in itertools.pairwise(at_step)]
    assert per_step == [0] * len(per_step), f"host reads of device values per training step: {per_step}"


def test_on_step_may_end_the_run_after_a_step() -> None:
    """A benchmark's time budget: `on_step` returning True ends the run after that step, its metrics read."""
    model, source, windows, head, settings = synthetic_run()
    seen: list[int] = []

    def on_step(step: int, tokens: int) -> bool:
        seen.append(step)
        return step == 3

    history = train(
        model, source, windows, [], settings, head=head, device=torch.device("cpu"), log=print, on_step=on_step
    )
    assert seen == [1, 2, 3]
    assert len(history.step_loss) == len(history.grad_norm) == 3


def test_the_first_steps_gradient_is_the_documented_loss_gradient():
    """The gradient norm the trainer records for its first step (before clipping) against the loss written
    out per window and per position from the module docstring: each window's TTT-weighted soft
    cross-entropy over its completion positions, divided by its completion tokens, averaged over the
    step's windows (so a trainer that scales its loss wrongly, on one process or several, fails here)."""
    import copy

    model, source, windows, head, settings = synthetic_run(seed=3)
    reference = copy.deepcopy(model)
    history = train(
        model, source, windows, [], settings, head=head, device=torch.device("cpu"), log=print, stop_after_steps=1
    )
    step = [windows[i] for i in plan_steps(windows, settings.batch_tokens, settings.seed, 0)[0]]
    assert len(step) > 1
    head_draft = head[reference.draft_ids]
    total = torch.zeros((), dtype=torch.float64)
    for w in step:
        d, a, b = source[w.sample_id], w.start, w.end
        tokens, mask = d["input_ids"][a:b].long(), d["loss_mask"][a:b]
        final = d["final_hidden_state"][a:b].float()
        teacher_p, argmax = torch.softmax(final @ head_draft.T, -1), (final @ head.T).argmax(-1)
        logits = reference.unroll(d["aux_hidden_states"][a:b].float(), tokens, torch.arange(a, b), settings.ttt_steps)
        completion = max(1, int(mask.sum()))
        for k, lg in enumerate(logits):
            for t in range(b - a):  # step k at t predicts token t+2+k, taught by the target at t+1+k
                if t + 2 + k < b - a and mask[t + 2 + k] == 1 and bool(reference.t2d[argmax[t + 1 + k]]):
                    ce = -(teacher_p[t + 1 + k] * torch.log_softmax(lg[t], -1)).sum()
                    total = total + settings.step_decay**k * ce.double() / completion / len(step)
    grads = torch.autograd.grad(total, [p for p in reference.parameters() if p.requires_grad])
    squares = sum(g.double().square().sum() for g in grads)
    assert isinstance(squares, torch.Tensor)
    want = float(torch.sqrt(squares))
    assert history.step_loss[0] == pytest.approx(float(total.detach()), rel=1e-5)
    assert history.grad_norm[0] == pytest.approx(want, rel=1e-4)


@pytest.mark.slow
def test_the_compiled_mlp_trains_as_the_eager_one() -> None:
    """`compile` (on CUDA by default) really compiles the MLP, and the compiled run takes the eager run's steps: a
    compiler failure falls back to eager by design, so only `history.compiled` shows that the path ran."""
    import dataclasses

    histories = []
    for compile_ in (False, True):
        model, source, windows, head, settings = synthetic_run(seed=5)
        histories.append(
            train(
                model,
                source,
                windows,
                [],
                dataclasses.replace(settings, compile=compile_),
                head=head,
                device=torch.device("cpu"),
                log=print,
            )
        )
    eager, compiled = histories
    assert (eager.compiled, compiled.compiled) == (False, True)
    assert len(compiled.step_loss) == len(eager.step_loss) >= 5
    assert compiled.step_loss == pytest.approx(eager.step_loss, rel=1e-4)


def test_a_layout_moved_to_a_device_is_a_copy() -> None:
    """`DocLayout.to` leaves the host layout on the host, as `Tensor.to` does (a host batch stays usable)."""
    host = DocLayout(LENGTHS, waste=2.0)
    moved = host.to(torch.device("meta"))
    tensors = lambda layout: [layout.doc_id, layout.end, layout.back, *(idx for _, _, idx in layout.groups)]  # noqa: E731
    assert {t.device.type for t in tensors(host)} == {"cpu"}
    assert {t.device.type for t in tensors(moved)} == {"meta"}
