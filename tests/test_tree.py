"""Draft trees: masks and positions, static tree parsing, and the EAGLE-2 node selection."""

import pytest
import torch

from specchat.decode.drafting.selection import Candidates
from specchat.decode.drafting.tree import MC_SIM_7B_63, MC_SIM_7B_63_ACCEPTED, DraftTree, parse_static_tree, trim_static_tree
from specchat.decode.engine.growing import verify_inputs


def test_mc_sim_7b_63_has_the_published_shape():
    depths = [len(p) for p in MC_SIM_7B_63]
    assert len(MC_SIM_7B_63) == 25 and [depths.count(d) for d in range(1, 6)] == [4, 8, 8, 3, 2]
    parents = {p[:-1] for p in MC_SIM_7B_63 if len(p) > 1}
    assert len(MC_SIM_7B_63) - len(parents) == 15  # leaves


def test_verify_inputs_give_tree_attention_and_depth_positions():
    #   root ─ a ─ c
    #        └ b
    tree = DraftTree(tokens=[7, 8, 9], parents=[-1, -1, 0], depths=[1, 1, 2], probs=[0.5, 0.3, 0.9])
    ids, positions, mask = verify_inputs(tree, root=5, cached=4, device="cpu")
    assert ids.tolist() == [[5, 7, 8, 9]]
    assert positions.tolist() == [[4, 5, 5, 6]]
    tail = mask[0, 0, :, 4:].int().tolist()
    assert tail == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert mask[0, 0, :, :4].all()
    assert tree.children() == [[0, 1], [2], [], []]


def test_static_tree_parsing():
    assert parse_static_tree("mc_sim_7b_63") == MC_SIM_7B_63
    assert parse_static_tree("[[0], [1], [0, 0]]") == ((0,), (1,), (0, 0))
    with pytest.raises(ValueError, match="no parent path"):
        parse_static_tree("[[0], [1, 0]]")
    with pytest.raises(ValueError, match="JSON list"):
        parse_static_tree("not-a-tree")


def test_trimming_keeps_the_most_accepted_nodes_as_a_tree():
    paths = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    accepted = (500, 200, 300, 40, 90, 120)
    assert trim_static_tree(paths, 4, accepted) == ((0,), (1,), (0, 0), (0, 0, 0))
    assert trim_static_tree(paths, 2, accepted) == ((0,), (0, 0))
    # A child counted above its parent (not from one trace, but possible in a hand-made table) waits for it.
    assert trim_static_tree(paths, 2, (10, 5, 1, 1, 50, 1)) == ((0,), (1,))


@pytest.mark.parametrize("nodes", [1, 8, 15, 24])
def test_the_measured_mc_sim_trim_is_a_tree_of_the_asked_size(nodes):
    trimmed = trim_static_tree(MC_SIM_7B_63, nodes, MC_SIM_7B_63_ACCEPTED)
    assert len(trimmed) == nodes and set(trimmed) <= set(MC_SIM_7B_63)
    assert all(len(path) == 1 or path[:-1] in trimmed for path in trimmed)
    assert len(MC_SIM_7B_63_ACCEPTED) == len(MC_SIM_7B_63)


def test_eagle_verifies_the_static_tree_within_the_token_budget():
    from types import SimpleNamespace

    from specchat.proposers import default_static_tree
    from specchat.settings import Settings

    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert default_static_tree(Settings(method="eagle", total_tokens=16), cpu) == \
        trim_static_tree(MC_SIM_7B_63, 15, MC_SIM_7B_63_ACCEPTED)
    assert default_static_tree(Settings(method="eagle", total_tokens=60), cpu) == MC_SIM_7B_63


def test_selection_keeps_a_connected_tree_of_the_best_paths():
    # Level 1: three nodes; level 2: children of node 0 and node 1.
    tokens = torch.tensor([10, 11, 12, 20, 21, 22, 23])
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 1])
    depths = torch.tensor([1, 1, 1, 2, 2, 2, 2])
    logps = torch.tensor([0.6, 0.3, 0.1, 1.0, 0.0001, 0.5, 0.5]).log()
    scores = torch.cat([logps[:3], logps[3:5] + logps[0], logps[5:] + logps[1]])
    tree = Candidates(tokens.tolist(), parents.tolist(), depths.tolist(), logps.exp().tolist(), scores.tolist()).select(4)
    # Best paths: 0 (.6), its child 20 (.6, ties the parent: parent first), 1 (.3), then .15 twice (21? no: 22/23).
    assert tree.tokens == [10, 11, 20, 22]
    assert tree.parents == [-1, -1, 0, 1] and tree.depths == [1, 1, 2, 2]
    assert all(p < i for i, p in enumerate(tree.parents))
