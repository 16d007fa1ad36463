"""A small generated English corpus for the tests and the smoke run (no downloads).

``python -m models.corpus DIR [--documents N] [--seed S]`` writes ``DIR/part-K.jsonl``
(one document per line, a ``"text"`` field) and a few ``DIR/story-K.txt`` (one document
each): short stories from a template grammar. Each document has its own cast (a person,
a place, an object) named again and again inside it and never outside it: the one thing to
remember within a document and to forget at the next, which is what resetting the state at
document starts is for. Deterministic in (documents, seed).

What it is not: a language-modelling benchmark; its perplexity says nothing about real text.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

NAMES = ("Ada", "Brook", "Cyril", "Dora", "Emil", "Fenna", "Gus", "Hana", "Ivo", "Juno",
         "Kai", "Lena", "Milo", "Nia", "Otto", "Pia", "Quin", "Rosa", "Sven", "Tess")
PLACES = ("the harbour", "the mill", "the orchard", "the station", "the library",
          "the bakery", "the bridge", "the market", "the lighthouse", "the garden")
THINGS = ("a lantern", "a map", "a violin", "a kite", "a compass", "a letter", "a key",
          "a teapot", "a clock", "a red umbrella")
VERBS = ("found", "lost", "carried", "mended", "painted", "hid", "sold", "borrowed")
ADJ = ("old", "quiet", "bright", "cold", "small", "busy", "windy", "green")
TEMPLATES = (
    "{name} walked to {place} on a {adj} morning.",
    "At {place}, {name} {verb} {thing}.",
    "Nobody at {place} had seen {thing} before.",
    "{name} said that {thing} belonged to {place}.",
    "Later {name} {verb} {thing} again, and smiled.",
    "The {adj} wind blew across {place} while {name} waited.",
    "{name} wrote a note about {thing} and left it at {place}.",
    "By evening {place} was {adj}, and {name} went home.",
)


def document(rng: np.random.Generator, sentences=(3, 25)) -> str:
  """One story of ``sentences[0] .. sentences[1] - 1`` sentences."""
  cast = {"name": NAMES[rng.integers(len(NAMES))], "place": PLACES[rng.integers(len(PLACES))],
          "thing": THINGS[rng.integers(len(THINGS))]}
  lines = []
  for _ in range(int(rng.integers(*sentences))):
    template = TEMPLATES[rng.integers(len(TEMPLATES))]
    lines.append(template.format(**cast, verb=VERBS[rng.integers(len(VERBS))],
                                     adj=ADJ[rng.integers(len(ADJ))]))
  paragraphs = [" ".join(lines[i:i + 4]) for i in range(0, len(lines), 4)]
  return "\n\n".join(paragraphs) + "\n"


def write_corpus(folder: str, documents: int = 400, seed: int = 0, txt_files: int = 4,
                 sentences=(3, 25)) -> str:
  """Writes ``documents`` documents (``txt_files`` of them as .txt files) to ``folder``."""
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(seed)
  docs = [document(rng, sentences) for _ in range(documents)]
  for k in range(min(txt_files, documents)):
    with open(os.path.join(folder, f"story-{k}.txt"), "w") as f:
      f.write(docs[k])
  rest = docs[txt_files:]
  per_file = max(1, (len(rest) + 3) // 4)
  for k in range(0, len(rest), per_file):
    with open(os.path.join(folder, f"part-{k // per_file}.jsonl"), "w") as f:
      for text in rest[k:k + per_file]:
        f.write(json.dumps({"text": text}) + "\n")
  return folder


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("folder")
  parser.add_argument("--documents", type=int, default=2000)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  write_corpus(args.folder, args.documents, args.seed)
  print(f"{args.documents} documents in {args.folder}")


if __name__ == "__main__":
  main()
