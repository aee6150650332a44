"""Draft trees: masks and positions, static tree parsing, and the EAGLE-2 node selection."""

import pytest
import torch

from specchat.decode.drafting.selection import Candidates
from specchat.decode.drafting.growth import HeadSteps
from specchat.decode.drafting.tree import MC_SIM_7B_63, MC_SIM_7B_63_ACCEPTED, DraftTree, parse_static_tree, trim_static_tree
from specchat.decode.acceptance.verify import ancestor_mask
from specchat.decode.engine.fixed import verify_rows
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


def random_tree(generator: torch.Generator, nodes: int) -> DraftTree:
    """A tree of `nodes` nodes, parents before children, each parent drawn among the root and the earlier nodes."""
    parents = [int(torch.randint(-1, node, (1,), generator=generator)) for node in range(nodes)]
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    tokens = torch.randint(0, 50, (nodes,), generator=generator).tolist()
    return DraftTree(tokens=tokens, parents=parents, depths=depths, probs=[0.5] * nodes)


def test_the_fixed_layouts_verify_rows_are_the_growing_layouts_verify_inputs():
    """One rule, two forms (`growing.verify_inputs` on the host, the reference; `fixed.verify_rows`
    on the device, in a window of the fixed capacity): on random trees, the same ids, positions and
    mask over the context and the tree, and nothing seen beyond them."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(60):
        nodes, cached = int(torch.randint(1, 12, (1,), generator=generator)), int(torch.randint(0, 9, (1,), generator=generator))
        tree = random_tree(generator, nodes)
        ids, positions, mask = verify_inputs(tree, root=3, cached=cached, device="cpu")
        device_tree = DraftTree(tokens=torch.tensor(tree.tokens), parents=torch.tensor(tree.parents),
                                depths=torch.tensor(tree.depths), probs=torch.tensor(tree.probs),
                                valid=torch.ones(nodes, dtype=torch.bool), depth=max(tree.depths))
        span = cached + nodes + 1 + int(torch.randint(0, 5, (1,), generator=generator))
        fixed_ids, fixed_positions, fixed_mask, slots = verify_rows(
            device_tree, torch.tensor([3]), torch.tensor(cached), span, ancestor_mask(device_tree))
        assert torch.equal(fixed_ids, ids) and torch.equal(fixed_positions, positions), trial
        assert torch.equal(fixed_mask[..., : cached + nodes + 1], mask), trial
        assert not fixed_mask[..., cached + nodes + 1:].any(), trial
        assert slots.tolist() == list(range(cached, cached + nodes + 1))


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


class _SeededSteps(HeadSteps):
    """A head as the shapes run it (`HeadSteps`), on random weights: each output depends on its input
    hidden state, its token, its depth and every cache entry it attends to, so a wrong mask, parent
    or beam gives another tree. Its narrowing keeps the beam nodes above a score, in both forms."""

    reads_votes = True

    def __init__(self, seed: int, vocab: int = 40, hidden: int = 8, entries: int = 64):
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(100 + vocab, hidden, generator=generator)  # by target id
        self.lm_head = torch.randn(hidden, vocab, generator=generator) * 2
        self.entry_vectors = torch.randn(entries, hidden, generator=generator) * 0.5
        self.floor = -1.5 - 2 * float(torch.rand((), generator=generator))
        self.vocabulary = 100 + torch.randperm(vocab, generator=generator)  # draft ids -> target ids
        self.target_ids = self.vocabulary.tolist()  # (`HeadSteps.to_target_on_host`)

    def feed(self, hidden, tokens, level, first_entry, entries, both=False):
        seen = entries.float() @ self.entry_vectors[: entries.shape[1]]
        return torch.tanh(hidden + self.embed[tokens] + 0.1 * level + seen), None

    def top(self, outputs, k):
        return torch.log_softmax(outputs @ self.lm_head, -1).topk(k, dim=-1)

    def to_target(self, draft_ids):
        return self.vocabulary[draft_ids]

    def stops(self, fired, growth):
        return bool(fired)

    def narrow(self, growth, beam, depth):
        return beam[growth.table.scores[beam] > self.floor]

    def narrow_on_host(self, table, beam, depth):
        return [node for node in beam if table.scores[node] > self.floor]


def _paths(table) -> dict[tuple[int, ...], float]:
    """Each drafted node's path of tokens from the root, with its score."""
    candidates = Candidates.from_table(table)
    paths = []
    for node, parent in enumerate(candidates.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (candidates.tokens[node],))
    return {path: score for path, score in zip(paths, candidates.scores) if score > float("-inf")}


@pytest.mark.parametrize("deagle", [False, True], ids=["eagle2", "deagle"])
def test_a_tree_grown_on_host_lists_is_the_tree_grown_on_tensors(deagle):
    """The growing layout grows EAGLE-2 and DEAGLE trees on host lists (`DynamicTree.grow_on_host`);
    on random heads, beams narrowed by score and DEAGLE's votes, it gives `_grow`'s tree on tensors:
    the same nodes (paths of tokens) with the same scores, and the same levels drafted."""
    from specchat.decode.drafting.deagle import DeagleParams
    from specchat.decode.drafting.shapes import DeagleTree, DynamicTree, DynamicTreeParams

    for seed in range(40):
        generator = torch.Generator().manual_seed(1000 + seed)
        top_k, depth = int(torch.randint(1, 5, (), generator=generator)), int(torch.randint(1, 7, (), generator=generator))
        params = DynamicTreeParams(total_tokens=int(torch.randint(2, 20, (), generator=generator)), depth=depth, top_k=top_k)
        shape = DeagleTree(params, DeagleParams()) if deagle else DynamicTree(params)
        steps = _SeededSteps(seed)
        root = torch.randn(8, generator=generator)
        on_tensors = shape.grow(steps, root, depth, 30)
        on_host = shape.grow_on_host(steps, root, depth, 30)
        tensor_paths, host_paths = _paths(on_tensors), _paths(on_host)
        assert tensor_paths.keys() == host_paths.keys()
        assert all(abs(tensor_paths[path] - host_paths[path]) < 1e-5 for path in tensor_paths)
        if deagle:  # (S_d, rho_d and E_d summed in float32 on tensors, in float64 on the host)
            tensor_trace, host_trace = shape.trace(on_tensors), shape.trace(on_host)
            assert (tensor_trace.stop_depth, tensor_trace.votes) == (host_trace.stop_depth, host_trace.votes)
            for ours, theirs in zip(tensor_trace.depths, host_trace.depths, strict=True):
                assert ours.votes == theirs.votes
                assert ours.mass == pytest.approx(theirs.mass, abs=1e-5) and ours.rho == pytest.approx(theirs.rho, abs=1e-4)
                assert ours.expected == pytest.approx(theirs.expected, abs=1e-5)
