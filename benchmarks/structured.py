"""A generated, labelled knowledge graph with structure a model can learn: people, groups, cities, items.

Random graphs (``training.generate_graph``) time a step well but have nothing to learn, so their
link-prediction quality says nothing. This graph has the patterns real graphs have, drawn from a
hidden topic per group:

* ``member_of`` (person -> group): every person joins one to three groups, mostly of one topic;
* ``located_in`` (group -> city): every group is in one city;
* ``lives_in`` (person -> city): the city of one of the person's groups (a composition of the two);
* ``knows`` (person <-> person): people who share a group, both directions (symmetric);
* ``parent_of`` / ``child_of``: parents and children in the same city, each edge in both relations (inverse);
* ``likes`` (person -> item): items of the person's topics (topic-driven).

With the defaults it has 4,560 entities and about 47k triples, split 90/5/5 at random; a test or
validation triple whose entity does not occur in training is moved to training.

    python benchmarks/structured.py --output structured/     # writes train.txt, valid.txt, test.txt
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

__all__ = ["structured_triples", "write_splits"]


def structured_triples(  # noqa: C901  # one block per relation family: the graph's definition in one place
    num_people: int = 3000,
    num_groups: int = 300,
    num_cities: int = 60,
    num_items: int = 1200,
    num_topics: int = 12,
    likes_per_person: int = 8,
    seed: int = 0,
) -> np.ndarray:
    """The graph's labelled triples, ``[T, 3]`` strings (head, relation, tail), without duplicates."""
    rng = np.random.default_rng(seed)
    group_topic = rng.integers(num_topics, size=num_groups)
    group_city = rng.integers(num_cities, size=num_groups)
    item_topic = rng.integers(num_topics, size=num_items)
    groups_of_topic = [np.flatnonzero(group_topic == topic) for topic in range(num_topics)]
    items_of_topic = [np.flatnonzero(item_topic == topic) for topic in range(num_topics)]
    triples: set[tuple[str, str, str]] = set()
    person_groups: list[np.ndarray] = []
    for person in range(num_people):
        topic = rng.integers(num_topics)
        while not len(groups_of_topic[topic]):  # a small graph may leave a topic without groups
            topic = rng.integers(num_topics)
        count = rng.integers(1, 4)
        own = rng.choice(groups_of_topic[topic], size=min(count, len(groups_of_topic[topic])), replace=False)
        if rng.random() < 0.3:  # some people also join a group of another topic
            own = np.unique(np.append(own, rng.integers(num_groups)))
        person_groups.append(own)
        for group in own:
            triples.add((f"person{person}", "member_of", f"group{group}"))
        triples.add((f"person{person}", "lives_in", f"city{group_city[rng.choice(own)]}"))
        topics = np.unique(group_topic[own])
        liked = np.concatenate([items_of_topic[t] for t in topics])
        for item in rng.choice(liked if len(liked) else np.arange(num_items), size=likes_per_person):
            triples.add((f"person{person}", "likes", f"item{item}"))
    for group in range(num_groups):
        triples.add((f"group{group}", "located_in", f"city{group_city[group]}"))
    members: list[list[int]] = [[] for _ in range(num_groups)]
    for person, own in enumerate(person_groups):
        for group in own:
            members[group].append(person)
    for person, own in enumerate(person_groups):
        peers = np.concatenate([members[group] for group in own])
        peers = peers[peers != person]
        for other in rng.choice(peers, size=min(2, len(peers)), replace=False) if len(peers) else ():
            triples.add((f"person{person}", "knows", f"person{other}"))
            triples.add((f"person{other}", "knows", f"person{person}"))
    city_people: dict[str, list[int]] = {}
    for head, relation, tail in sorted(triples):  # sorted: a set's order changes with the interpreter's hash seed
        if relation == "lives_in":
            city_people.setdefault(tail, []).append(int(head.removeprefix("person")))
    for people in city_people.values():
        people.sort()
        for child in people:
            if rng.random() < 0.35 and len(people) > 1:
                parent = people[rng.integers(len(people))]
                if parent != child:
                    triples.add((f"person{parent}", "parent_of", f"person{child}"))
                    triples.add((f"person{child}", "child_of", f"person{parent}"))
    return np.asarray(sorted(triples), dtype=str)


def write_splits(directory: pathlib.Path, seed: int = 0, **kwargs: int) -> pathlib.Path:
    """Write the graph's ``train.txt``, ``valid.txt`` and ``test.txt`` (90/5/5) into ``directory``; return it."""
    triples = structured_triples(seed=seed, **kwargs)
    order = np.random.default_rng(seed + 1).permutation(len(triples))
    evaluated = len(triples) // 20
    parts = {"valid": order[:evaluated], "test": order[evaluated : 2 * evaluated], "train": order[2 * evaluated :]}
    seen = set(triples[parts["train"]][:, [0, 2]].reshape(-1).tolist())
    for name in ("valid", "test"):  # triples with an entity unseen in training go to training
        unseen = np.array([not {h, t} <= seen for h, _, t in triples[parts[name]]], dtype=bool)
        parts["train"] = np.concatenate([parts["train"], parts[name][unseen]])
        parts[name] = parts[name][~unseen]
        seen |= set(triples[parts[name][unseen]][:, [0, 2]].reshape(-1).tolist()) if unseen.any() else set()
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in parts.items():
        lines = ["\t".join(triple) for triple in triples[np.sort(rows)]]
        (directory / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=pathlib.Path, required=True, help="the directory of the three splits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--people", type=int, default=3000, help="the number of people (the graph's size)")
    args = parser.parse_args()
    directory = write_splits(args.output, seed=args.seed, num_people=args.people)
    for name in ("train", "valid", "test"):
        print(f"{name}: {len((directory / f'{name}.txt').read_text().splitlines())} triples")


if __name__ == "__main__":
    main()
