"""Collective token lookup on 2 and 3 gloo ranks: rows, gradients and model queries equal the full table's."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import rank_zygote
import torch
from lookup_worker import full_table, request
from pykeen.predict import predict_target


pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("lookup_worker.py")


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    world_size = request.param
    output = tmp_path_factory.mktemp(f"lookup{world_size}")
    results = rank_zygote.launch(world_size, [str(WORKER), json.dumps(dict(output=str(output)))], timeout=300)
    assert results.ok, results.report()
    loaded = [torch.load(output / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    for result in loaded:
        result["output"] = output
    return loaded


@pytest.mark.parametrize("variant", ["routed", "gathered"])
def test_rows_and_gradients_equal_the_full_table(ranks: list[dict[str, Any]], variant: str) -> None:
    """Every rank gets the rows of its own ids; the owners' gradients are the full table's, restricted to their rows."""
    full = full_table()  # [N, 3, 2]
    expected_grad = torch.zeros_like(full)
    for rank, result in enumerate(ranks):
        ids, weights = request(rank)
        torch.testing.assert_close(result["table"][variant]["rows"], full[ids], rtol=0, atol=0)
        expected_grad.index_add_(0, ids.reshape(-1), weights.reshape(-1, 3, 2))
    for result in ranks:
        rows = result["table"]["entity_rows"]
        held = (rows >= 0).nonzero().view(-1)
        grad = result["table"][variant]["grad"]
        torch.testing.assert_close(grad[rows[held]], expected_grad[held].reshape(held.numel(), -1))
        assert grad.shape[0] < full.shape[0]  # one shard per rank


def test_routed_lookup_sends_only_requested_rows(ranks: list[dict[str, Any]]) -> None:
    """Routed: ids and rows of other ranks' entities only; gathered: every rank's padded request, n - 1 times."""
    world_size = len(ranks)
    for rank, result in enumerate(ranks):
        ids, _ = request(rank)
        owned = result["table"]["entity_rows"][ids.reshape(-1)] >= 0
        # forward: this rank's ids of others (8 bytes), the rows others asked of it (48 bytes); backward likewise
        asked = sum(
            int((result["table"]["entity_rows"][request(other)[0].reshape(-1)] >= 0).sum())
            for other in range(world_size)
            if other != rank
        )
        remote = int((~owned).sum())
        assert result["table"]["routed"]["bytes"] == remote * 8 + asked * 48 + remote * 48
        longest = max(request(other)[0].numel() for other in range(world_size))
        assert result["table"]["gathered"]["bytes"] == (world_size - 1) * longest * (8 + 48 + 48)


def test_model_queries_on_the_sharded_model_equal_the_gathered_model(ranks: list[dict[str, Any]]) -> None:
    """score_hrt, score_t, predict_target and the entity representation, each rank with its own queries."""
    model = torch.load(ranks[0]["output"] / "model.pt", weights_only=False)
    model.eval()
    for result in ranks:
        queries = result["model"]
        triples = queries["triples"]
        with torch.no_grad():
            torch.testing.assert_close(queries["score_hrt"], model.score_hrt(triples))
            torch.testing.assert_close(queries["score_t"], model.score_t(triples[:, :2]))
            torch.testing.assert_close(queries["entities"], model.entity_representations[0]())
        prediction = predict_target(model, head=int(triples[0, 0]), relation=int(triples[0, 1]))
        assert queries["predict_target"] == prediction.df[["tail_id", "score"]].to_dict("list")
