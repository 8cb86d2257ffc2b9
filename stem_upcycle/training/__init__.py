"""Recovery training of converted STEM models: `stem-upcycle train RECIPE.yaml`."""
