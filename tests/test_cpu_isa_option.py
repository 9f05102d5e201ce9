"""`--cpu-isa`: the native CPU kernels' instruction-set path, chosen from the CLI down to the
kernels (an AVX2 host's speed and bits on an AVX-512 machine), refused where it cannot apply."""

from __future__ import annotations

import argparse

import pytest

from deepserve.engine.config import EngineConfig
from deepserve.engine.errors import UnsupportedModelError
from deepserve.engine.loading.loader import load_model
from deepserve.kernels.cpu import native
from deepserve.server.cli import add_engine_args, engine_config_from_args


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_flag_reaches_the_engine_config():
    assert parse("--cpu-isa", "avx2").cpu_isa == "avx2"
    assert parse().cpu_isa is None


def test_an_unknown_path_is_refused():
    with pytest.raises(ValueError, match="--cpu-isa"):
        EngineConfig(cpu_isa="sse4")


def test_a_gpu_engine_refuses_it():
    with pytest.raises(UnsupportedModelError, match="--device cpu"):
        load_model(EngineConfig(device="cuda", cpu_isa="avx2"))


def test_loading_a_model_puts_the_kernels_on_the_chosen_path():
    if not native.load() or "avx2" not in native.supported_isas():
        pytest.skip("the native CPU kernels do not load here")
    before = native.isa()
    try:
        load_model(EngineConfig(model="tiny-deepseek", cpu_isa="avx2"))
        assert native.isa() == "avx2"
    finally:
        native.set_isa(before)
