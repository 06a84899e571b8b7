"""LoRA adapters in the worker: PEFT files read and checked (peft_adapter), kept in host memory (adapter_store),
run from device slots beside the base model's linears (lora_slots)."""
