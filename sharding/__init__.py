"""Mesh construction and the logical->mesh axis rules."""
