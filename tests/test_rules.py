"""config/rules.py: the one table of which settings refuse which, and the optimizer facts it keeps."""
from __future__ import annotations

from vramfit.config.rules import COMPACT_STATE_OPTIMIZERS, PROCESS_RULES, RULES, config_problems, process_problems
from vramfit.config.schema import RunConfig, TrainConfig
from vramfit.optim.build import optimizer_class


def test_compact_state_names_the_optimizers_whose_class_says_so():
    names = TrainConfig.model_fields["optimizer"].annotation.__args__
    assert COMPACT_STATE_OPTIMIZERS == {n for n in names if optimizer_class(n).compact_state}


def test_each_rule_refuses_its_key_and_names_the_other_setting():
    cases = {
        "train.compile": {"train": {"compile": True}, "memory": {"stream_weights": True}},
        "train.cuda_graphs": {"train": {"cuda_graphs": True, "mode": "lora"}, "lora": {"dropout": 0.1}},
        "sample.every_steps": {"sample": {"every_steps": 5, "prompts": ["a"]}, "memory": {"stream_weights": True},
                               "cache": {"text": False}},
        "train.steps": {"train": {"steps": 5, "epochs": 2}},
        "save.every_epochs": {"save": {"every_epochs": 1, "every_steps": 5}},
        "sample.every_epochs": {"sample": {"every_epochs": 1, "every_steps": 5, "prompts": ["a"]}},
        "train.zero_terminal_snr": {"train": {"zero_terminal_snr": True, "prediction_type": "epsilon"}},
        "train.debiased_estimation": {"train": {"debiased_estimation": True, "min_snr_gamma": 5.0}},
        "train.weighting_scheme": {"train": {"weighting_scheme": "cosmap", "debiased_estimation": True}},
        "train.huber_c": {"train": {"huber_c": 0.3}},
        "train.huber_schedule": {"train": {"huber_schedule": "constant"}},
        "train.flow_shift": {"train": {"flow_shift": 2.0, "flow_shift_mode": "resolution"}},
        "train.optimizer_in_backward": {"train": {"optimizer": "prodigy", "optimizer_in_backward": True}},
        "memory.stream_weights": {"train": {"optimizer": "came"}, "memory": {"stream_weights": True}},
        "ema.device": {"ema": {"enabled": True}, "memory": {"stream_weights": True}},
        "memory.resident_blocks": {"memory": {"resident_blocks": 3}},
        "memory.streamed_grad_sums": {"memory": {"stream_weights": True, "streamed_grad_sums": "device"}},
        "lora.type": {"lora": {"type": "dora", "base_quantization": "int8"}},
        "lora.conv_alpha": {"lora": {"conv_alpha": 4}},
        "lora.lokr_factor": {"lora": {"lokr_factor": 4}},
        "lora.dropout": {"lora": {"type": "lokr", "dropout": 0.1}},
        "lora.text_encoder_rank": {"train": {"mode": "lora", "optimizer_in_backward": True},
                                   "lora": {"text_encoder_rank": 4}},
        "train.text_encoders": {"train": {"text_encoders": "full", "optimizer_in_backward": True}},
    }
    assert set(cases) == {r.key for r in RULES}  # every rule is tried
    for key, values in cases.items():
        cfg = RunConfig.model_construct(**{s: getattr(RunConfig(), s).model_copy(update=v) for s, v in values.items()})
        for section, v in values.items():  # what the user wrote counts as written
            object.__setattr__(getattr(cfg, section), "__pydantic_fields_set__", set(v))
        assert [k for k, _ in config_problems(cfg)] == [key], key


def test_several_processes_refuse_what_does_not_compose_and_one_process_nothing():
    cfg = RunConfig.model_construct(train=TrainConfig(distributed="fsdp", mode="lora", optimizer="adafactor",
                                                      optimizer_in_backward=True))
    lines = process_problems(cfg, 2)
    assert [line.split(":")[0] for line in lines] == ["train.distributed", "train.optimizer",
                                                      "train.optimizer_in_backward"]
    assert "'adafactor' does not compose with 'fsdp' with 2 processes" in lines[1]
    assert process_problems(cfg, 1) == [] and len(PROCESS_RULES) == 12
    ema = RunConfig.model_construct(train=TrainConfig(distributed="fsdp", optimizer="adamw"),
                                    ema=RunConfig().ema.model_copy(update={"enabled": True}))
    assert [line.split(":")[0] for line in process_problems(ema, 2)] == ["ema.enabled"]
