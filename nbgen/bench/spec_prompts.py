"""The extractive prompt set of ``python -m nbgen.bench.spec``: short passages and tasks that repeat them
(quote, copy-edit, summarise, list). Plain text written for nbgen's benchmark."""
from __future__ import annotations

PASSAGES = [
    "The lighthouse on Gull Point was built in 1871 from granite quarried two miles inland. Its lamp "
    "burned whale oil until 1902, when the keepers switched to kerosene, and an electric lamp replaced "
    "both in 1934. The last keeper, Martha Ellison, left the station in 1968, and the light has run "
    "automatically ever since. Today the keeper's cottage is a small museum that opens on summer weekends.",
    "To repot a houseplant, choose a pot one size larger than the old one and make sure it has a drainage "
    "hole. Water the plant a day before so the roots hold together. Turn the old pot on its side, ease the "
    "plant out, and loosen any roots that circle the bottom. Set it in the new pot on a layer of fresh soil, "
    "fill around it, press the soil gently, and water it well.",
    "The city council met on Tuesday evening to discuss the new bus routes. Route 4 will now stop at the "
    "hospital and the central library, and Route 9 will run every fifteen minutes instead of every twenty. "
    "The changes start on the first of March. Council member Diaz said the plan was shaped by more than "
    "two thousand replies to last autumn's survey of riders.",
    "Photosynthesis takes place in the chloroplasts of plant cells. Light energy is absorbed by chlorophyll "
    "and used to split water into oxygen, protons and electrons. The electrons pass along a transport chain "
    "that makes ATP and NADPH, and the Calvin cycle then uses these to turn carbon dioxide into sugars. The "
    "oxygen leaves the leaf through small pores called stomata.",
]

TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Copy the passage below, changing only every 'the' at the start of a sentence to 'THE':\n\n{p}",
    "Here is a passage:\n\n{p}\n\nQuote its first two sentences exactly.",
    "Summarise this passage in a few sentences, reusing its wording:\n\n{p}",
]


def extractive_chats() -> list[list[dict[str, str]]]:
    """One single-turn conversation per (task, passage) pair: 16 prompts."""
    return [[{"role": "user", "content": t.format(p=p)}] for t in TASKS for p in PASSAGES]
