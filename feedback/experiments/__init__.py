"""A/B experiments: their life in the store, the decision rule, promotion, the evaluate job."""
