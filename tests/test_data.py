"""The bundled arithmetic data: deterministic batches, shapes, labels, masking and correct answers."""

from __future__ import annotations

import re

import pytest
import torch

from megatrain.data import IGNORE, ByteTokenizer, DataConfig, batch

LINE = re.compile(r"^(\d+)([+\-*])(\d+)=(-?\d+)$")


def complete_lines(row: torch.Tensor) -> list[str]:
    """The problems of one sequence that fit whole (the last one is usually cut off)."""
    text = ByteTokenizer.decode(row.tolist())
    return text.split("\n")[:-1]


@pytest.mark.parametrize("seed, t", [(0, 0), (0, 7), (3, 7)])
def test_batch_is_deterministic_in_seed_and_step(seed: int, t: int) -> None:
    cfg = DataConfig(seq_len=48, batch_size=4, seed=seed)
    ids, labels = batch(cfg, t)
    batch(cfg, t + 1)  # other calls in between change nothing
    ids2, labels2 = batch(DataConfig(seq_len=48, batch_size=4, seed=seed), t)
    assert torch.equal(ids, ids2) and torch.equal(labels, labels2)


def test_batches_differ_across_steps_and_seeds() -> None:
    cfg = DataConfig(seq_len=48, batch_size=4, seed=0)
    ids0, _ = batch(cfg, 0)
    assert not torch.equal(ids0, batch(cfg, 1)[0])
    assert not torch.equal(ids0, batch(DataConfig(seq_len=48, batch_size=4, seed=1), 0)[0])
    assert not torch.equal(ids0[0], ids0[1])  # rows of one batch differ too


@pytest.mark.parametrize("batch_size, seq_len", [(1, 2), (3, 17), (8, 128)])
def test_shapes_and_dtypes(batch_size: int, seq_len: int) -> None:
    ids, labels = batch(DataConfig(seq_len=seq_len, batch_size=batch_size), 2)
    assert ids.shape == (batch_size, seq_len) and labels.shape == (batch_size, seq_len)
    assert ids.dtype == torch.int64 and labels.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < ByteTokenizer.vocab_size


@pytest.mark.parametrize("loss_on", ["all", "answers"])
def test_labels_equal_ids_where_not_ignored(loss_on: str) -> None:
    ids, labels = batch(DataConfig(seq_len=64, batch_size=5, loss_on=loss_on), 3)
    keep = labels != IGNORE
    assert torch.equal(labels[keep], ids[keep])
    if loss_on == "all":
        assert bool(keep.all())
    else:
        assert 0 < int(keep.sum()) < keep.numel()


def test_loss_on_answers_masks_exactly_the_question_tokens() -> None:
    cfg = DataConfig(seq_len=96, batch_size=6, loss_on="answers", seed=5)
    ids, labels = batch(cfg, 11)
    ids_all, _ = batch(DataConfig(seq_len=96, batch_size=6, loss_on="all", seed=5), 11)
    assert torch.equal(ids, ids_all)  # masking does not change the data
    eq, nl = ord("="), ord("\n")
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
        in_question = True  # every sequence starts with a question
        for tok, lab in zip(row_ids, row_labels):
            if in_question:
                assert lab == IGNORE, (chr(tok), row_ids)
                if tok == eq:
                    in_question = False  # '=' itself is the question's last token
            else:
                assert lab == tok, (chr(tok), row_ids)  # answer digits, sign and the newline
                if tok == nl:
                    in_question = True


@pytest.mark.parametrize("ops, max_operand", [("+-*", 99), ("-", 5), ("*", 999), ("+", 0)])
def test_decoded_text_is_arithmetic_with_correct_answers(ops: str, max_operand: int) -> None:
    cfg = DataConfig(seq_len=128, batch_size=4, ops=ops, max_operand=max_operand, seed=2)
    ids, _ = batch(cfg, 9)
    seen_ops, count = set(), 0
    for row in ids:
        lines = complete_lines(row)
        assert lines, ByteTokenizer.decode(row.tolist())
        for line in lines:
            m = LINE.match(line)
            assert m, line
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert 0 <= a <= max_operand and 0 <= b <= max_operand, line
            assert op in ops
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op], line
            seen_ops.add(op)
            count += 1
    assert count >= 8
    assert seen_ops == set(ops)


def test_byte_tokenizer_round_trip() -> None:
    text = "12*34=408\n7-9=-2\n"
    assert ByteTokenizer.encode(text) == list(text.encode())
    assert ByteTokenizer.decode(ByteTokenizer.encode(text)) == text
    assert ByteTokenizer.decode([ord("a"), 300, -1, ord("b")]) == "ab"  # ids outside bytes are dropped


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kind="wikitext"),
        dict(seq_len=1),
        dict(batch_size=0),
        dict(ops="/"),
        dict(ops=""),
        dict(loss_on="questions"),
    ],
)
def test_data_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        DataConfig(**kwargs)


def _problems_in(ids: torch.Tensor) -> list[tuple[int, str, int]]:
    out = []
    for row in ids:
        for line in complete_lines(row):  # rows start with a whole problem
            m = LINE.match(line)
            out.append((int(m[1]), m[2], int(m[3])))
    return out


def test_training_never_sees_a_held_out_problem_and_evaluation_sees_only_them() -> None:
    from megatrain.data.arithmetic import eval_batch, eval_problems, held_out

    cfg = DataConfig(seq_len=128, batch_size=8, seed=1)
    train = [p for t in range(20) for p in _problems_in(batch(cfg, t)[0])]
    evaluation = [p for i in range(5) for p in _problems_in(eval_batch(cfg, i)[0])]
    assert len(train) > 500 and len(evaluation) > 100
    assert not any(held_out(*p) for p in train)
    assert all(held_out(*p) for p in evaluation)
    problems = eval_problems(cfg)
    assert len(problems) == cfg.eval_problems
    for q, a in problems:
        m = LINE.match(q + a)
        assert m and held_out(int(m[1]), m[2], int(m[3]))
    for op in "+-*":  # every operator has held-out problems, about a tenth
        assert 0.08 < sum(held_out(a, op, b) for a in range(100) for b in range(100)) / 10000 < 0.12, op


def test_a_tiny_problem_space_is_not_split() -> None:
    from megatrain.data.arithmetic import eval_problems

    cfg = DataConfig(seq_len=32, batch_size=2, ops="+", max_operand=2, eval_problems=4)
    assert _problems_in(batch(cfg, 0)[0]) and len(eval_problems(cfg)) == 4  # terminates, nothing held out


@pytest.mark.parametrize("ops, max_operand", [("+-*", 99), ("+", 9), ("-", 50), ("*", 999)])
def test_greedy_decoding_of_a_perfect_model_is_fully_correct(ops: str, max_operand: int) -> None:
    """An oracle predict (the true next character) through the prompt layout and answer parsing."""
    from megatrain.data.arithmetic import accuracy, answers, eval_problems, prompts

    cfg = DataConfig(ops=ops, max_operand=max_operand, eval_problems=30)
    problems = eval_problems(cfg)
    ids, pos, new = prompts(cfg, problems)
    truth = [ByteTokenizer.encode(q + a + "\n") for q, a in problems]
    generated = torch.zeros((len(problems), new), dtype=torch.long)
    for k in range(new):  # what the executor does: predict after pos, write it in, move on
        for r in range(len(problems)):
            p = int(pos[r]) + 1
            if p <= len(truth[r]):
                assert ids[r, :p].tolist() == truth[r][:p]  # the model sees exactly the text so far
            tok = truth[r][p] if p < len(truth[r]) else ord("\n")
            generated[r, k] = tok
            if p < ids.shape[1]:
                ids[r, p] = tok
        pos += 1
    got = answers(generated)
    assert got == [a for _, a in problems] and accuracy(problems, got) == 1.0
    assert accuracy(problems, ["?"] * len(problems)) == 0.0
