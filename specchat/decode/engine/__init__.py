"""The engine and its two cache layouts (the map of the whole core: `specchat.decode`)."""
