"""The teacher computes the target's full-vocabulary argmax only where the loss reads it (the position before each
completion token), and training sees exactly what it saw when every position was computed."""

from __future__ import annotations

import torch
from test_drafter_packed_training import tiny_drafter

from eagle3_assets.stages.eagle3_drafter.data import Teacher, Window, pack_windows
from eagle3_assets.stages.eagle3_drafter.train import TrainSettings, packed_loss

VOCAB, H = 3000, 16
# two prompt/completion turns in one sample, then a sample that is all completion, then one with none
MASKS = [
    [0] * 9 + [1] * 6 + [0] * 5 + [1] * 4,
    [1] * 11,
    [0] * 8,
]


def source(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, mask in enumerate(MASKS):
        n = len(mask)
        out[f"s{i}"] = {
            "input_ids": torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.int8),
            "aux_hidden_states": torch.randn(n, 3 * H, generator=g),
            "final_hidden_state": torch.randn(n, H, generator=g),
        }
    return out


def test_the_argmax_is_computed_exactly_where_a_completion_token_follows():
    g = torch.Generator().manual_seed(1)
    head = torch.randn(VOCAB, H, generator=g)
    data = source()
    windows = [Window(k, 0, len(v["input_ids"])) for k, v in data.items()]
    batch = pack_windows(data, windows, torch.float32, pin=False)
    teacher = Teacher(head, torch.arange(0, VOCAB, 7), torch.device("cpu"))
    _, got = teacher.packed(batch)
    full = (batch.final.float() @ head.T).argmax(-1)  # every position, written out
    mask = batch.mask.tolist()
    starts = [0, len(MASKS[0]), len(MASKS[0]) + len(MASKS[1])]
    for start, m in zip(starts, MASKS, strict=True):
        for j in range(len(m)):
            read = j + 1 < len(m) and m[j + 1] == 1  # position j's teacher weighs the prediction of token j+1
            assert got[start + j].item() == (full[start + j].item() if read else -1), (start, j, mask)
    # the cache returns the same, without recomputing
    _, again = teacher.packed(batch)
    assert torch.equal(again, got)


def test_the_loss_with_the_needed_argmax_equals_the_loss_with_every_position_computed():
    head = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(2))
    model = tiny_drafter(vocab=VOCAB, draft=1000, H=H, dtype=torch.float32)  # even ids < 2000: some argmaxes outside
    data = source(seed=3)
    windows = [Window(k, 0, len(v["input_ids"])) for k, v in data.items()]
    batch = pack_windows(data, windows, torch.float32, pin=False)
    teacher_p, needed_only = Teacher(head, model.draft_ids, torch.device("cpu")).packed(batch)
    every = (batch.final.float() @ head.T).argmax(-1)
    assert not torch.equal(needed_only, every)  # the shortcut did skip positions
    settings = TrainSettings(ttt_steps=4)
    loss_a, steps_a = packed_loss(model, model, batch, teacher_p, needed_only, settings, len(windows))
    loss_b, steps_b = packed_loss(model, model, batch, teacher_p, every, settings, len(windows))
    assert loss_a.item() > 0
    assert torch.equal(loss_a, loss_b) and torch.equal(steps_a, steps_b)
    grads = [torch.autograd.grad(loss, list(model.parameters()), allow_unused=True) for loss in (loss_a, loss_b)]
    for a, b in zip(*grads, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
