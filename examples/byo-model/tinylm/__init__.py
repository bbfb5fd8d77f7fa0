"""A small decoder of the user's own, written from scratch: zero1's python model kind trains it."""
