"""An emulated accelerator: everything of kvpush runs for real except the model's forward, whose time comes
from a profile's clock and whose KV is deterministic bytes in the profile's geometry (docs/emulation.md).

    profile.py    the profile format: KV geometry per rank, the step clock, the link; load by name or path
    roofline.py   GPU profiles from hardware constants, the model's shape and efficiencies
    published.py  published measurements a profile is held against, and what a profile predicts for them
    shipped.py    regenerates the shipped profiles (profiles/*.json)
"""
