"""The benchmark routing stand-in: Zipf popularity per layer, reuse between steps, behind vLLM's switch."""

from __future__ import annotations

import pytest
import torch

from engine_patches.moe.routing_standin import STRATEGY, ZipfReuseRouting


def _steps(routing: ZipfReuseRouting, batch: int, steps: int) -> torch.Tensor:
    return torch.stack([routing.route(batch, "cpu")[1] for _ in range(steps)])  # [steps, batch, k]


def _kept_share(ids: torch.Tensor) -> float:
    """Share of a row's experts that its previous step also had."""
    prev, cur = ids[:-1], ids[1:]
    hits = (cur.unsqueeze(-1) == prev.unsqueeze(-2)).any(-1)
    return hits.float().mean().item()


def test_each_row_gets_top_k_distinct_experts_with_weights_summing_to_one():
    torch.manual_seed(0)
    routing = ZipfReuseRouting(128, 8, layer=0)
    weights, ids = routing.route(64, "cpu")
    assert ids.shape == (64, 8) and ids.dtype == torch.int64
    assert all(len(set(row.tolist())) == 8 for row in ids)
    assert int(ids.min()) >= 0 and int(ids.max()) < 128
    assert torch.allclose(weights.sum(1), torch.ones(64))


def test_a_row_keeps_about_half_its_experts_from_one_step_to_the_next():
    torch.manual_seed(1)
    fresh = _kept_share(_steps(ZipfReuseRouting(128, 8, layer=0, reuse=0.0), 32, 60))
    half = _kept_share(_steps(ZipfReuseRouting(128, 8, layer=0, reuse=0.5), 32, 60))
    frozen = _steps(ZipfReuseRouting(128, 8, layer=0, reuse=1.0), 32, 10)
    # Without reuse a row meets its last experts again only through popularity; with 0.5 it keeps
    # half of them and may draw some of the others again.
    assert fresh < 0.3
    assert 0.5 < half < 0.5 + 0.5 * fresh + 0.05
    assert all(torch.equal(frozen[0].sort(1).values, s.sort(1).values) for s in frozen)


def test_popular_experts_are_routed_to_far_more_often_and_each_layer_has_its_own():
    torch.manual_seed(2)
    layer0, layer1 = ZipfReuseRouting(128, 8, layer=0, reuse=0.0), ZipfReuseRouting(128, 8, layer=1, reuse=0.0)
    counts = torch.bincount(_steps(layer0, 64, 40).flatten(), minlength=128).float()
    order = layer0.popularity.argsort(descending=True)
    top, tail = counts[order[:8]].mean(), counts[order[-64:]].mean()
    assert top > 5 * tail
    assert int(layer0.popularity.argmax()) != int(layer1.popularity.argmax())


def test_the_same_seed_and_layer_give_every_process_the_same_popularity():
    a, b = ZipfReuseRouting(128, 8, layer=3), ZipfReuseRouting(128, 8, layer=3)
    assert torch.equal(a.popularity, b.popularity)
    assert not torch.equal(a.popularity, ZipfReuseRouting(128, 8, layer=3, seed=1).popularity)


def test_batches_larger_than_the_kept_rows_are_routed_too():
    routing = ZipfReuseRouting(16, 4, layer=0, rows=8)
    _, ids = routing.route(20, "cpu")  # a prefill longer than the rows it remembers
    assert ids.shape == (20, 4) and all(len(set(r.tolist())) == 4 for r in ids)


def test_it_is_built_on_the_host_whatever_default_device_vllm_builds_the_model_under():
    with torch.device("meta"):  # vLLM builds the layers under the GPU as default device
        routing = ZipfReuseRouting(16, 4, layer=0)
    _, ids = routing.route(3, "cpu")
    assert ids.device.type == "cpu" and ids.shape == (3, 4)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        ZipfReuseRouting(4, 8, layer=0)
    with pytest.raises(ValueError, match="reuse"):
        ZipfReuseRouting(8, 2, layer=0, reuse=1.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_graph_replay_routes_the_next_step():
    routing = ZipfReuseRouting(128, 8, layer=0, reuse=0.0)
    routing.route(4, "cuda")  # eager first call makes the state, as vLLM's profiling run does
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, ids = routing.route(4, "cuda")
    seen = []
    for _ in range(3):
        graph.replay()
        seen.append(ids.clone().cpu())
    step = routing._state(torch.device("cuda"))[1]
    assert int(step) == 4  # the eager call and three replays: a capture runs nothing
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])  # new rows each step
    assert torch.equal(seen[2], routing._trace[3].view(64, 8)[:4].cpu())  # the trace's step, read in the graph


def test_vllm_routes_through_the_stand_in_only_when_its_switch_names_it(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.router.routing_simulator_router import RoutingSimulatorRouter

    from engine_patches.vllm_adapters import routing_standin
    from engine_patches.vllm_adapters.patching import unwrap_all

    monkeypatch.delenv(routing_standin.ENV_VAR, raising=False)
    assert routing_standin.install() == []
    monkeypatch.setenv(routing_standin.ENV_VAR, STRATEGY)
    try:
        assert "RoutingSimulatorRouter._compute_routing" in routing_standin.install()
        routers = [RoutingSimulatorRouter(top_k=2, global_num_experts=8) for _ in range(2)]
        hidden, logits = torch.zeros(5, 16), torch.zeros(5, 8)
        for router in routers:
            weights, ids = router.select_experts(hidden, logits, topk_indices_dtype=torch.int32)
            assert ids.dtype == torch.int32 and ids.shape == (5, 2)
            assert all(len(set(r.tolist())) == 2 for r in ids)
            assert torch.allclose(weights.sum(1), torch.ones(5))
        first, second = (r.__dict__["_zipf_reuse"] for r in routers)
        assert second.layer == first.layer + 1  # each layer its own state, numbered as built
        assert routing_standin.ROUTED_LAYERS[-2:] == [first, second]
    finally:
        unwrap_all()


@pytest.mark.parametrize("accuracy", [1.0, 0.7, 0.0])
def test_a_guess_drawn_ahead_is_right_about_as_often_as_asked_and_routes_the_next_call(accuracy):
    routing = ZipfReuseRouting(64, 8, layer=3)
    right = total = 0
    for _ in range(200):
        guess = routing.draw_ahead(4, "cpu", accuracy)
        _, ids = routing.route(4, "cpu")  # the routing drawn ahead, not a new draw
        right += int((guess == ids).sum())
        total += ids.numel()
    # A wrong entry is a draw by popularity, which is right by chance now and then.
    share = right / total
    assert accuracy - 0.05 <= share <= accuracy + 0.2 if accuracy < 1 else share == 1.0


def test_a_call_with_no_draw_ahead_draws_afresh():
    routing = ZipfReuseRouting(64, 8, layer=0)
    routing.draw_ahead(4, "cpu", 1.0)
    _, ids = routing.route(2, "cpu")  # another batch size: the drawn routing is not this call's
    assert ids.shape == (2, 8)
    with pytest.raises(ValueError, match="accuracy"):
        routing.draw_ahead(4, "cpu", 1.5)
