"""Which operations commit which path, and the step a path names."""

import pytest

from tierfs.core.commit import CommitRules, Rule, parse_rules, step_of
from tierfs.core.errors import UserError

DEFAULT = CommitRules(parse_rules("default"))


@pytest.mark.parametrize(
    "path, step",
    [
        ("ckpt/500", 500),
        ("checkpoint-500", 500),
        ("run7/step_120/model.pt", 120),
        ("epoch=1-step=200.ckpt", 200),
        ("model.pt", None),
        ("a/b", None),
        ("12/model.pt", 12),
        # A labelled number wins; shard and rank numbers are never steps.
        ("out/checkpoint-500/model-00001-of-00002.safetensors", 500),
        ("ckpt/step-7/rank-3.pt", 7),
        ("ckpt/7/rank-3.pt", 7),
        ("ckpt/7/__0_0.distcp", 7),
        ("nemo/step=100-consumed_samples=800.0", 100),
        ("megatron/iter_0000300/mp_rank_00", 300),
        ("global_step40/zero_pp_rank_0_mp_rank_00_optim_states.pt", 40),
    ],
)
def test_step_is_the_labelled_or_last_number_in_the_path(path, step):
    assert step_of(path) == step


@pytest.mark.parametrize(
    "path, root",
    [
        ("ckpt/100", "ckpt/100"),  # Orbax: <step>.orbax-checkpoint-tmp -> <step>
        ("nemo/10", "nemo/10"),
        ("ckpt/latest", None),  # no number: not a step directory
        ("ckpt/100.orbax-checkpoint-tmp", None),
        ("tmp/100", None),  # anything temporary never commits
    ],
)
def test_directory_renames(path, root):
    assert DEFAULT.dir_renamed(path) == root


@pytest.mark.parametrize(
    "path, root",
    [
        ("ckpt/100/commit_success.txt", "ckpt/100"),
        ("dcp/step_7/.metadata", "dcp/step_7"),
        ("ckpt/100/_CHECKPOINT_METADATA", "ckpt/100"),
        ("out/checkpoint-500/trainer_state.json", "out/checkpoint-500"),
        ("ckpt/100.orbax-checkpoint-tmp/_CHECKPOINT_METADATA", None),  # waits for the rename
        ("commit_success.txt", None),  # a marker needs a directory to commit
        ("model-3.pt", "model-3.pt"),
        ("a/b/weights.safetensors", "a/b/weights.safetensors"),
        ("lightning/epoch=0-step=10.ckpt", "lightning/epoch=0-step=10.ckpt"),
        ("ckpt/data.bin", None),
        ("tmp-checkpoint-5/model.safetensors", None),
    ],
)
def test_files_closed(path, root):
    assert DEFAULT.file_done(path) == root


def test_custom_rules_replace_the_defaults_and_default_adds_them():
    rules = CommitRules(parse_rules("file:*.bin"))
    assert rules.file_done("x/data.bin") == "x/data.bin"
    assert rules.file_done("x/model.pt") is None
    both = parse_rules("default,file:*.bin")
    assert Rule("file", "*.bin") in both and Rule("file", "*.pt") in both
    assert parse_rules("none") == ()


@pytest.mark.parametrize("text", ["bogus:*.pt", "file:", "*.pt", "dir:a/b"])
def test_bad_rules_are_one_line_user_errors(text):
    with pytest.raises(UserError, match="invalid commit rule"):
        parse_rules(text)
