import random

import pytest
from fixtures import write_tiny_drafter, write_tiny_target

from dflash_local import Engine
from dflash_local.convert.init_drafter import init_drafter
from dflash_local.models import default_target

_WORDS = (
    "the a river code function model token fast slow cat dog write read list sum value "
    "number city language speed draft verify block return class import print loop data "
    "paper music light night water green blue small large tree house def if else while"
).split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Deterministic, varied prompts: prose and code fragments."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12)))
        if i % 3 == 0:
            prompts.append(f"def {rng.choice(_WORDS)}(x):\n    # {words}\n")
        elif i % 3 == 1:
            prompts.append(words.capitalize() + ".")
        else:
            prompts.append(f"Q: {words}?\nA:")
    return prompts


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_target(models_dir):
    return write_tiny_target(models_dir / "tiny-target.gguf")


@pytest.fixture(scope="session")
def tiny_drafter(models_dir, tiny_target):
    return write_tiny_drafter(models_dir / "tiny-drafter.gguf", tiny_target, target_layers=(1, 3), block_size=8)


@pytest.fixture(scope="session")
def tiny_engine(tiny_target, tiny_drafter):
    # full blocks every step: the tests below count on every acceptance length being tried
    return Engine(tiny_target, tiny_drafter, n_ctx=1024, draft_policy="fixed")


@pytest.fixture(scope="session")
def gemma_target():
    return default_target()


@pytest.fixture(scope="session")
def gemma_drafter(models_dir, gemma_target):
    # an untrained drafter shaped like a small DFlash drafter for gemma-3-270m (hidden 640, 18 layers)
    return init_drafter(
        models_dir / "gemma-drafter.gguf", gemma_target, n_target_layers=3, block_size=4, head_dim=64, n_ff=512
    )


@pytest.fixture(scope="session")
def gemma_engine(gemma_target, gemma_drafter):
    return Engine(gemma_target, gemma_drafter, n_ctx=2048, draft_policy="fixed")
