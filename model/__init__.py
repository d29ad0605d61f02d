"""The Flax NNX transformer; logical axis names only, never mesh axis names."""
