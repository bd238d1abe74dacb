"""The EAGLE-3 drafter: model, draft vocabulary, training-time-test training, SGLang export."""
