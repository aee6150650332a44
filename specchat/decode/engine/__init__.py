"""The engine and its two cache layouts (the core's map: `specchat.decode`)."""
