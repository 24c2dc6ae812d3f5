"""What every other part of models/ stands on: the durable write (`durable`), validated records (`schema`), imports
by name (`lazy`), where this copy of the project lives (`install`) and safetensors files (`safetensors_io`).
It imports nothing else of the project."""
