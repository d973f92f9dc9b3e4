"""The FinetuneJob API (finetune.dev/v1alpha1)."""
