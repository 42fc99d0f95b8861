"""How a second-hand listing gives itself away: words in the text, a sticker in the photo.

New items never carry any of these cues; `mentions_secondhand` finds them, so
tests (and anyone auditing a catalogue) can check that.
"""

from __future__ import annotations

import re

from schemas import Condition

TITLE_CUES: dict[Condition, tuple[str, ...]] = {
    Condition.like_new: ("Open Box", "Like New", "Pre-Owned"),
    Condition.used: ("Pre-Owned", "Used", "Second-Hand", "Vintage"),
    Condition.refurbished: ("Refurbished", "Certified Refurbished", "Renewed"),
}

DESCRIPTION_CUES: dict[Condition, tuple[str, ...]] = {
    Condition.like_new: (
        "Open box item in like-new condition; the original packaging has been opened.",
        "Pre-owned but like new: worn once and stored in a smoke-free home.",
        "Barely used, with no visible marks.",
    ),
    Condition.used: (
        "Gently used, with minor signs of wear.",
        "Pre-owned item in good used condition; see the photos for details.",
        "Vintage, worn: light scuffs from years of use.",
        "Second-hand: shows normal signs of wear.",
    ),
    Condition.refurbished: (
        "Professionally refurbished and fully tested.",
        "Certified refurbished: inspected, cleaned and repackaged.",
        "Renewed unit; small cosmetic marks are possible.",
    ),
}

# Text on the sticker drawn onto second-hand product photos.
STICKER_LABELS: dict[Condition, str] = {
    Condition.like_new: "LIKE NEW",
    Condition.used: "USED",
    Condition.refurbished: "REFURB",
}

SECONDHAND_CUE_PATTERN = re.compile(
    r"\b(pre-owned|used|refurbished|renewed|open box|like[- ]new|second-hand|vintage|worn"
    r"|signs of wear|scuffs?)\b",
    re.IGNORECASE,
)


def mentions_secondhand(text: str) -> bool:
    """True when `text` contains any second-hand cue word or phrase."""
    return SECONDHAND_CUE_PATTERN.search(text) is not None
