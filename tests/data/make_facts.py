"""Write ``facts.json``: the project's own fact file in known_1000's format (known_id, subject,
attribute, template, prompt, relation_id, prediction), so the machinery tests run in a fresh
clone with nothing beside it. Subjects are coined names (seeded), attributes real places,
languages, instruments and trades; the facts are consistent, so a tiny model can learn them.

    python tests/data/make_facts.py        # rewrites tests/data/facts.json (deterministic)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

COUNTRIES = ["France", "Italy", "Spain", "Germany", "Japan", "Brazil", "Canada", "India",
             "Egypt", "Norway", "Mexico", "Kenya", "Chile", "Greece", "Poland", "Sweden"]
CONTINENT = {"France": "Europe", "Italy": "Europe", "Spain": "Europe", "Germany": "Europe",
             "Japan": "Asia", "Brazil": "America", "Canada": "America", "India": "Asia",
             "Egypt": "Africa", "Norway": "Europe", "Mexico": "America", "Kenya": "Africa",
             "Chile": "America", "Greece": "Europe", "Poland": "Europe", "Sweden": "Europe"}
LANGUAGE = {"France": "French", "Italy": "Italian", "Spain": "Spanish", "Germany": "German",
            "Japan": "Japanese", "Brazil": "Portuguese", "Canada": "English", "India": "Hindi",
            "Egypt": "Arabic", "Norway": "Norwegian", "Mexico": "Spanish", "Kenya": "Swahili",
            "Chile": "Spanish", "Greece": "Greek", "Poland": "Polish", "Sweden": "Swedish"}
INSTRUMENTS = ["piano", "guitar", "violin", "trumpet", "drums", "cello", "flute", "saxophone"]
TRADES = ["actor", "painter", "lawyer", "architect", "chemist", "poet", "diplomat", "pilot"]
RELATIONS = [
    ("P17", "{} is located in the country of", "place"),
    ("P27", "{}, who has a citizenship of", "person"),
    ("P30", "{} is located in the continent of", "place"),
    ("P103", "The mother tongue of {} is", "person"),
    ("P1303", "{} plays the", "person"),
    ("P106", "{} works as a", "person"),
]
SYLLABLES = ["ka", "lo", "ren", "ta", "vi", "mar", "so", "del", "ri", "no", "bel", "tor", "an",
             "qui", "ze", "por", "li", "gan", "us", "fe"]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def facts(n: int = 1200, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        relation, template, kind = RELATIONS[len(out) % len(RELATIONS)]
        if kind == "place":
            subject = f"{_name(rng, 2)} {rng.choice(['Lake', 'Bridge', 'Valley', 'Tower'])}"
        else:
            subject = f"{_name(rng, 2)} {_name(rng, 3)}"
        if subject in seen:
            continue
        seen.add(subject)
        country = rng.choice(COUNTRIES)
        attribute = {"P17": country, "P27": country, "P30": CONTINENT[country],
                     "P103": LANGUAGE[country], "P1303": rng.choice(INSTRUMENTS),
                     "P106": rng.choice(TRADES)}[relation]
        prompt = template.format(subject)
        out.append({"known_id": len(out), "subject": subject, "attribute": attribute,
                    "template": template, "prediction": f" {attribute}.",
                    "prompt": prompt, "relation_id": relation})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("facts.json")
    lines = ",\n".join(json.dumps(fact) for fact in facts())
    path.write_text(f"[\n{lines}\n]\n")
    print(f"wrote {path}")
