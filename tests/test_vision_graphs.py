"""The vision tower's plans and CUDA graphs (``models/vision_plan.py``, ``runtime/vision_graphs.py``).

CPU: how a step's images split into graph chunks; the tower over a batch equals the concatenation of the
tower over its chunks (what the chunked graphs rely on); plans cached per grid signature.
GPU (``gpu`` mark): graph replays equal the eager tower for two grid signatures; an engine's greedy outputs
are the same with the tower graphs on and off, and the graphs ran.
"""
from __future__ import annotations

import pytest
import torch

import nbgen

from nbgen.bench.tiny_vlm import make_tiny_vlm
from nbgen.models.loader import iter_safetensors
from nbgen.models.model_config import read_model_config
from nbgen.models.registry import get_model_class, prepare_config
from nbgen.runtime.vision_graphs import TowerGraphs, chunk_images
from tests.tiny_models import output_ids, random_images, vlm_image_run

G448 = (1, 32, 32)


def test_chunks_are_power_of_two_runs_of_equal_images():
    assert chunk_images([G448] * 27) == [(G448, 8, True)] * 3 + [(G448, 2, True), (G448, 1, True)]
    a, b = (1, 4, 6), (1, 8, 8)
    assert chunk_images([a, a, a, b, a], max_patches=64) == [(a, 2, True), (a, 1, True), (b, 1, True), (a, 1, True)]
    assert chunk_images([a] * 40, max_patches=10 ** 6) == [(a, 16, True)] * 2 + [(a, 8, True)]
    big = (1, 100, 100)                                    # larger than a chunk: one eager chunk
    assert chunk_images([big, big, a], max_patches=8192) == [(big, 2, False), (a, 1, True)]
    assert chunk_images([]) == []


def _model(family: str, tmp_path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    d = make_tiny_vlm(str(tmp_path / family), family)
    cfg = prepare_config(read_model_config(d))
    model = get_model_class(cfg)(cfg)
    model.load_weights(iter_safetensors(d))
    return d, model.to(device, dtype).eval()


def _pixels(d: str, images: list):
    import transformers as tf

    x = tf.AutoImageProcessor.from_pretrained(d)(images=images, return_tensors="pt")
    return x["pixel_values"], [tuple(g) for g in x["image_grid_thw"].tolist()]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_tower_of_a_batch_is_the_tower_of_its_chunks(family, tmp_path):
    d, model = _model(family, tmp_path)
    ims = random_images(8)
    pv, grids = _pixels(d, [ims[0]] * 3 + [ims[1]] * 2 + [ims[3]] * 3)     # three runs of equal grids
    with torch.no_grad():
        whole = model.encode_images(pv, grids)
        parts, row = [], 0
        for g, k, _ in chunk_images(grids, max_patches=2 * grids[0][1] * grids[0][2]):
            n = k * g[0] * g[1] * g[2]
            parts.append(model.encode_images(pv[row: row + n], [g] * k))
            row += n
    assert row == pv.shape[0] and len(parts) > 3
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)


def test_plans_are_cached_per_grid_signature(tmp_path):
    _, model = _model("qwen2_5_vl", tmp_path)
    cpu = torch.device("cpu")
    a, b = [(1, 4, 6)] * 2, [(1, 8, 8)]
    pa = model.image_plan(a, cpu)
    assert model.image_plan(list(a), cpu) is pa and model.image_plan(b, cpu) is not pa
    for i in range(1, 12):                                 # the least recently used plans are dropped
        model.image_plan([(1, 2 * i, 2)], cpu)
    assert model.image_plan(a, cpu) is not pa


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_graph_replays_equal_the_eager_tower(family, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    d, model = _model(family, tmp_path, "cuda")
    graphs = TowerGraphs(model, torch.device("cuda"))
    ims = random_images(8)
    batches = [_pixels(d, [ims[0]] * 3), _pixels(d, [ims[1]] * 4 + [ims[2]])]   # two grid signatures
    keys = {(g, k) for _, grids in batches for g, k, _ in chunk_images(grids)}
    with torch.inference_mode():
        eager = [model.encode_images(pv.cuda(), grids) for pv, grids in batches]
        for _ in range(3):                 # seen (eager chunks), captured, replayed; signatures interleaved
            for (pv, grids), want in zip(batches, eager):
                torch.testing.assert_close(graphs.encode(pv.cuda(), grids), want, atol=1e-4, rtol=1e-4)
    assert graphs.captures == len(keys) >= 3 and graphs.replays == 2 * sum(
        len(chunk_images(grids)) for _, grids in batches)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_engine_outputs_equal_with_tower_graphs_on_and_off(family, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    d = make_tiny_vlm(str(tmp_path / family), family, hidden_size=256, intermediate_size=512,
                      rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]})
    off = vlm_image_run(d, "cuda", "float32", attention_backend="torch", disable_vision_cuda_graph=True)
    with nbgen.Engine(d, device="cuda", dtype="float32", attention_backend="torch") as eng:
        prompts = [eng.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": f"Image {i}?"}]}]) for i in range(12)]
        prompts[3] = "Text only, no image."
        images = random_images(12)
        images[3] = None
        on = eng.generate(prompts, {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
                          image_data=images, use_tqdm=False)
        graphs = eng._loop.runner.vision.graphs          # read-only: the tower graphs ran
        assert graphs is not None and graphs.captures > 0 and graphs.replays > 0
    assert output_ids(on) == output_ids(off)
