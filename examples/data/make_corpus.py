"""Make examples/data/tiny-corpus.jsonl and its tokenizer.json: deterministic, from a seed.

The corpus is short templated English stories (2,500 documents, ~360 KB): regular enough
that a tiny model's loss falls within a minute, varied enough not to be memorised at once. The
tokenizer is a byte-level BPE of 512 tokens trained on it, <|endoftext|> (id 0) its EOS.

    python examples/data/make_corpus.py [--out DIR] [--documents N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena", "Milo", "Nora"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "rabbit", "goat", "duck", "mouse", "bear"]
ADJECTIVES = ["small", "old", "happy", "quiet", "brave", "sleepy", "clever", "tiny", "kind", "curious"]
PLACES = ["the garden", "the river", "the market", "the forest", "the hill", "the village", "the barn", "the lake"]
THINGS = ["an apple", "a red ball", "a book", "a blue hat", "some bread", "a kite", "a lamp", "a letter"]
TIMES = ["In the morning", "At noon", "In the evening", "One day", "Later", "After lunch", "At night"]
FEELINGS = ["glad", "tired", "hungry", "surprised", "calm", "proud"]


def sentence(rng: random.Random, hero: str, pet: str) -> str:
    """One sentence about the document's hero and their pet, from one of a few templates."""
    place = rng.choice(PLACES)
    thing = rng.choice(THINGS)
    time = rng.choice(TIMES)
    adjective = rng.choice(ADJECTIVES)
    feeling = rng.choice(FEELINGS)
    return rng.choice(
        [
            f"{time}, {hero} went to {place} with the {adjective} {pet}.",
            f"{hero} found {thing} near {place}.",
            f"The {pet} was {feeling}, so {hero} gave it {thing}.",
            f"{time}, the {adjective} {pet} ran to {place}.",
            f'{hero} said, "Look at the {pet}!" and everyone was {feeling}.',
            f"{hero} and the {pet} sat by {place} until it was dark.",
        ]
    )


def document(rng: random.Random) -> str:
    hero = rng.choice(NAMES)
    pet = rng.choice(ANIMALS)
    adjective = rng.choice(ADJECTIVES)
    opening = f"{hero} had {'an' if adjective[0] in 'aeiou' else 'a'} {adjective} {pet}."
    return " ".join([opening] + [sentence(rng, hero, pet) for _ in range(rng.randint(1, 3))])


def write_corpus(path: Path, *, documents: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = [document(rng) for _ in range(documents)]
    path.write_text("".join(json.dumps({"id": i, "text": text}) + "\n" for i, text in enumerate(texts)))
    return texts


def write_tokenizer(path: Path, texts: list[str], *, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    path.write_text(tokenizer.to_str(pretty=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--documents", type=int, default=2500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    texts = write_corpus(args.out / "tiny-corpus.jsonl", documents=args.documents, seed=args.seed)
    write_tokenizer(args.out / "tokenizer.json", texts, vocab_size=args.vocab_size)


if __name__ == "__main__":
    main()
