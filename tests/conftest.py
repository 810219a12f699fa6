import sys
from pathlib import Path

import pytest

import minimlx  # noqa: F401  (before any test module imports mlx.core: minimlx.cpu.blas can then put MKL under MLX)

# The fixtures import the support modules (models, servers, ...) when they run: those import mlx.core.

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, loaded once for every module that generates with it."""
    from models import smollm2_path

    smollm2_path()
    return minimlx.load("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """name -> the tiny Hugging Face folder of tests/mlx_lm_reference.py's model `name`, built once per session."""
    from mlx_lm_reference import save_hf_model

    built = {}

    def get(name):
        if name not in built:
            built[name] = tmp_path_factory.mktemp(f"hf-{name}")
            save_hf_model(built[name], name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def qwen2_5_vl_chat(tmp_path_factory):
    """(folder, torch model, transformers image processor) of vision_models.py's tiny random Qwen2.5-VL over the
    character tokenizer, built once for the modules that test it directly and through the server."""
    from vision_models import save_qwen2_5_vl_chat

    folder = tmp_path_factory.mktemp("qwen2_5_vl-chat")
    return folder, *save_qwen2_5_vl_chat(folder)


@pytest.fixture(scope="session")
def qwen3_vl_chat(tmp_path_factory):
    """(folder, torch model, transformers image processor) of vision_models.py's tiny random Qwen3-VL over the
    character tokenizer, built once for the modules that test it directly and through the server."""
    from vision_models import save_qwen3_image_text

    folder = tmp_path_factory.mktemp("qwen3_vl-chat")
    return folder, *save_qwen3_image_text(folder, "Qwen3VL", chat=True)


@pytest.fixture(scope="session")
def idefics3_chat(tmp_path_factory):
    """(folder, torch model, transformers processor) of vision_models.py's tiny random Idefics3 over the character
    tokenizer and its chat template, built once for the modules that test it directly and through the server."""
    from vision_models import save_idefics3

    folder = tmp_path_factory.mktemp("idefics3")
    return folder, *save_idefics3(folder, seed=7)


@pytest.fixture(scope="session")
def adapted_llama(hf_folder, tmp_path_factory):
    """(folder, adapter folder): `hf_folder`'s tiny llama and a rank-4 LoRA of its last block's q, v and down
    projections, B random (as training leaves it), saved in PEFT's format."""
    import mlx.core as mx

    from minimlx.tune import AdapterSettings, adapters, attach, save_adapter

    folder = hf_folder("llama")
    model = minimlx.load_model(folder, "float32")
    attach(model, AdapterSettings(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), layers=1))
    mx.random.seed(7)
    for form in adapters(model).values():
        form.lora_b = mx.random.normal(form.lora_b.shape) * 0.5
    return folder, save_adapter(model.eval(), tmp_path_factory.mktemp("adapter"))


@pytest.fixture(scope="module")
def served():
    """A `minimlx serve` process on SmolLM2 with the default options, one per test module that asks for it."""
    from models import smollm2_path
    from servers import Served

    smollm2_path()
    server = Served()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """The tiny models of test_io_gguf_llamacpp.py and the GGUF files llama.cpp's converter made of them, once."""
    from llamacpp_models import convert_all

    return convert_all(tmp_path_factory)


@pytest.fixture(scope="session")
def fused_families(tmp_path_factory):
    """adapter_files.py's four families with their adapters, fused outputs and GGUF files (llama's minimlx-saved adapter
    converted by llama.cpp too), made once."""
    from adapter_files import fused_families

    return fused_families(tmp_path_factory.mktemp("fused"))


@pytest.fixture(scope="session")
def kquant_llama(tmp_path_factory):
    """kquant_llama.py's tiny llama: its F32, Q4_K_M, Q5_K_S and Q6_K files by type, written once."""
    from kquant_llama import kquant_llama

    return kquant_llama(tmp_path_factory.mktemp("kquant-llama"))


@pytest.fixture(scope="session")
def kquant_moe(tmp_path_factory):
    """kquant_llama.py's tiny llama with a mixture of 4 experts: its F32 and K-quant files by type, written once."""
    from kquant_llama import kquant_llama

    return kquant_llama(tmp_path_factory.mktemp("kquant-moe"), experts=4)


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    """(folder, transformers model, minimlx model, tokenizer) of the tiny random hybrid (tests/hybrid_model.py)."""
    from hybrid_model import hybrid_model

    import minimlx

    folder = tmp_path_factory.mktemp("hybrid")
    torch_model = hybrid_model(folder)
    model, tokenizer = minimlx.load(folder, dtype="float32")
    return folder, torch_model, model, tokenizer


@pytest.fixture(scope="session")
def tune_folders(tmp_path_factory):
    """(a tiny random llama's folder, a data folder of the reversing task) of tests/tuning.py, written once."""
    from tuning import copy_task, tiny_llama

    root = tmp_path_factory.mktemp("tune")
    return tiny_llama(root / "model"), copy_task(root / "data")
