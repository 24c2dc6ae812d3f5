"""Records ComfyUI's ImageCrop boxes for tests/data/comfy_image_crop.json (CI has no ComfyUI). Run from a ComfyUI
checkout with its own venv:

    cd COMFYUI && PYTHONPATH=. VENV/bin/python ANIMA/bench/comfy_crop_cases.py > ANIMA/tests/data/comfy_image_crop.json

Each case crops a 13x9 image whose pixel value is its index (row * 13 + column), so the first output pixel names the
box's left and top; the output's shape its size."""
import json
import sys

sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.cli_args  # noqa: E402 - ComfyUI's own modules, from its checkout

comfy.cli_args.args.cpu = True
import torch  # noqa: E402
from comfy_extras.nodes_images import ImageCrop  # noqa: E402

WIDTH, HEIGHT = 13, 9
BOXES = [(4, 3, 2, 1), (13, 9, 0, 0), (20, 20, 0, 0), (5, 5, 10, 7), (3, 3, 12, 8), (4, 4, 13, 9), (6, 2, 100, 100),
         (1, 1, 0, 8), (512, 512, 5, 3), (7, 9, 6, 0)]          # (width, height, x, y): inside, past the ends


def main() -> None:
    img = torch.arange(WIDTH * HEIGHT, dtype=torch.float32).reshape(1, HEIGHT, WIDTH, 1).repeat(1, 1, 1, 3)
    cases = []
    for w, h, x, y in BOXES:
        out = ImageCrop.execute(img, w, h, x, y).result[0]
        first = int(out[0, 0, 0, 0])
        cases.append({"width": w, "height": h, "x": x, "y": y, "left": first % WIDTH, "top": first // WIDTH,
                      "out_width": out.shape[2], "out_height": out.shape[1]})
    print(json.dumps({"source": "ComfyUI comfy_extras/nodes_images.py ImageCrop.execute on a 13x9 index image "
                                "(pixel value = row * 13 + column), recorded by bench/comfy_crop_cases.py",
                      "image": [WIDTH, HEIGHT], "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
