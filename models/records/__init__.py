"""The records written beside what they describe: a pack's or a bundle's manifest.json (`manifest`, the one reader
and writer of them)."""
