"""Session-wide fixtures: tiny demo models are written once per test run and shared."""

import pytest
import torch

from kiln.models.demo import DEMO_ARCHS, write_demo_model


@pytest.fixture(scope="session")
def demo_dirs(tmp_path_factory) -> dict:
    """One tiny model per supported architecture (GQA, odd heads, tied/untied, llama3 rope)."""
    root = tmp_path_factory.mktemp("demo")
    return {arch: write_demo_model(root / arch, arch=arch) for arch in DEMO_ARCHS}


@pytest.fixture(scope="session")
def hf_models(demo_dirs) -> dict:
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for arch, d in demo_dirs.items()
    }
