"""What the HTTP fuzz tests send and how they judge a refusal's `param` (shared by
tests/reliability/test_fuzz_api.py and tests/api/test_speech_fuzz.py)."""

from __future__ import annotations

import re

from hypothesis import strategies as st

# any JSON value a client could put in a field
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has neither
    st.text(max_size=12),
    st.lists(st.text(max_size=5), max_size=6),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)

# pydantic's location of a union member ("voice.str"), which is not a field a client sent
UNION_MEMBER = re.compile(r"\.(str|int|float|bool|list|dict)(\.|\[|$)|literal\[")
