"""`specchat train`: data, target regeneration, feature extraction and the training recipes for draft heads."""
