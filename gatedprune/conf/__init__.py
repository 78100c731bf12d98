"""The Hydra configs of gatedprune-train (a package, so Hydra can find them in an installed gatedprune)."""
