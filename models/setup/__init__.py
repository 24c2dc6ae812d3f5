"""Setting a machine up from model files: a ComfyUI-style models folder (`models_dir`) and the board bundle built
from one (`bundle`, `anima-models bundle`)."""
