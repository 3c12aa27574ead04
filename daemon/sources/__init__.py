"""Sources: each owns one kernel interface and turns what it says into Event records on the bus."""
