"""Photos as a model's input (odtrain/images.py): the size, crop, layout and normalisation, checked against the
recipe torchvision documents (Resize(N): shorter side to N, the longer truncated; CenterCrop(N): offsets
int(round((size - N) / 2)); ToTensor: /255; Normalize: (x - mean) / std), computed here with numpy."""
import json

import numpy as np
import pytest

from odtrain import images
from odtrain.data_loading import InputSpec, load_image_folder
from odtrain.graph.errors import ArgumentError, InputError

Image = pytest.importorskip("PIL.Image")


def spec(*shape, name="input"):
    return InputSpec(name, np.dtype(np.float32), tuple(shape))


def pattern(width, height, seed=0):
    """An RGB image of random pixels, and its pixels as an array [height, width, 3]."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels), pixels


@pytest.mark.parametrize("width, height, size, offset", [(120, 96, 96, (12, 0)), (96, 131, 96, (0, 18)),
                                                         (97, 96, 96, (0, 0)), (99, 96, 96, (2, 0))])
def test_a_photo_whose_shorter_side_is_the_size_is_only_cropped_at_its_centre(width, height, size, offset):
    # offsets: round(24 / 2) = 12, round(35 / 2) = 18, round(0.5) = 0 and round(1.5) = 2 (Python's and torchvision's)
    image, pixels = pattern(width, height)
    preprocessing = images.Preprocessing.resolve(spec("batch", 3, "height", "width"), size)
    left, top = offset
    expected = pixels[top:top + size, left:left + size].astype(np.float32) / 255
    np.testing.assert_array_equal(preprocessing.pixels(image), expected)
    np.testing.assert_array_equal(preprocessing.sample(image), expected.transpose(2, 0, 1))


def test_a_larger_photo_is_scaled_to_cover_then_cropped_and_normalised_per_channel():
    image, _ = pattern(200, 90, seed=1)
    preprocessing = images.Preprocessing.resolve(spec("batch", "height", "width", 3), "45", "imagenet")
    # shorter side 90 -> 45, longer 200 * 45 / 90 = 100; crop offset round(55 / 2) = 28 (banker's: 27.5 -> 28)
    scaled = np.asarray(image.resize((100, 45), Image.BILINEAR), dtype=np.float32) / 255
    expected = (scaled[:, 28:73] - np.float32([0.485, 0.456, 0.406])) / np.float32([0.229, 0.224, 0.225])
    np.testing.assert_allclose(preprocessing.sample(image), expected, rtol=0, atol=1e-6)
    assert preprocessing.layout == "NHWC" and preprocessing.sample(image).shape == (45, 45, 3)


@pytest.mark.parametrize("width, height, target, expected", [(200, 90, (45, 45), (100, 45)),
                                                             (90, 200, (45, 45), (45, 100)),
                                                             (100, 100, (30, 60), (60, 60)),
                                                             (300, 100, (30, 60), (90, 30)),
                                                             (333, 100, (96, 96), (319, 96))])
def test_the_scaled_size_covers_the_target_and_truncates_the_other_side(width, height, target, expected):
    target_height, target_width = target
    got = images.covering_size(width, height, target_width, target_height)
    assert got == expected and got[0] >= target_width and got[1] >= target_height


def test_grayscale_and_flattened_inputs_take_the_channel_average_statistics():
    image, pixels = pattern(8, 8)
    flat = images.Preprocessing.resolve(spec("batch", 64), normalize="imagenet")
    gray = np.asarray(image.convert("L"), dtype=np.float32) / 255
    expected = (gray - np.float32(sum(images.IMAGENET_MEAN) / 3)) / np.float32(sum(images.IMAGENET_STD) / 3)
    np.testing.assert_allclose(flat.sample(image), expected.reshape(64), atol=1e-6)
    assert (flat.layout, flat.channels, flat.height) == ("flat", 1, 8)


@pytest.mark.parametrize("text, mean, std", [("none", (0, 0, 0), (1, 1, 1)), ("0.5,0.25", (0.5,) * 3, (0.25,) * 3),
                                             ("0.1/0.2/0.3,0.4/0.5/0.6", (0.1, 0.2, 0.3), (0.4, 0.5, 0.6)),
                                             ("ImageNet", images.IMAGENET_MEAN, images.IMAGENET_STD)])
def test_normalize_takes_a_name_or_mean_and_std_per_channel(text, mean, std):
    assert images.parse_normalize(text, 3) == (tuple(map(float, mean)), tuple(map(float, std)))


@pytest.mark.parametrize("text, said", [("0.5", "MEAN,STD"), ("0.5,0", "STD must be positive"),
                                        ("0.1/0.2,0.5", "MEAN has 2 values"), ("127.5,58", "the [0, 1] scale"),
                                        ("a,b", "MEAN,STD")])
def test_a_malformed_normalize_is_refused_saying_what_is_wrong(text, said):
    with pytest.raises(ArgumentError, match=r"--normalize") as error:
        images.parse_normalize(text, 3)
    assert said in str(error.value)


@pytest.mark.parametrize("text, size", [("96", (96, 96)), ("96x128", (96, 128)), (64, (64, 64)), ((3, 5), (3, 5))])
def test_image_size_is_a_square_or_height_by_width(text, size):
    assert images.parse_size(text) == size


def test_a_symbolic_input_without_a_size_is_refused_naming_the_option():
    with pytest.raises(ArgumentError, match=r"input float32\[batch, 3, height, width\] has no fixed image size: "
                       r"give the size .* --image-size N"):
        images.Preprocessing.resolve(spec("batch", 3, "height", "width"))


def test_a_size_that_contradicts_a_fixed_input_is_refused():
    with pytest.raises(ArgumentError, match=r"--image-size 32x32 does not fit input .*16x16; leave --image-size out"):
        images.Preprocessing.resolve(spec("batch", 3, 16, 16), 32)
    assert images.Preprocessing.resolve(spec("batch", 3, 16, 16), 16).height == 16


def test_an_input_of_no_image_shape_is_refused():
    with pytest.raises(InputError, match="is not an image shape"):
        images.layout_of(spec("batch", 5, 7, 9))


def test_a_folder_of_photos_at_a_symbolic_size_records_its_preprocessing_and_classes(tmp_path):
    for kind in ("circle", "square"):
        (tmp_path / "photos" / kind).mkdir(parents=True)
        pattern(40, 30, seed=len(kind))[0].save(tmp_path / "photos" / kind / "a.png")
    inputs = [spec("batch", 3, "height", "width"), InputSpec("labels", np.dtype(np.int64), ("batch",), True)]
    from odtrain.data_loading import ImageFolder

    dataset = ImageFolder(str(tmp_path / "photos"), image_size="20x24", normalize="0.5,0.5",
                          record_to=str(tmp_path)).dataset(inputs)
    assert dataset.arrays[0].shape == (2, 3, 20, 24) and dataset.classes == ["circle", "square"]
    assert dataset.files == [str(tmp_path / "photos" / k / "a.png") for k in ("circle", "square")]
    stored = json.loads((tmp_path / "preprocessing.json").read_text())
    assert (stored["height"], stored["width"], stored["layout"], stored["mean"], stored["classes"]) == \
        (20, 24, "NCHW", [0.5] * 3, ["circle", "square"])
    assert images.recorded(tmp_path) == {"image_size": (20, 24), "normalize": "0.5,0.5",
                                         "classes": ["circle", "square"]}
    with pytest.raises(ArgumentError, match="--image-size"):
        load_image_folder(str(tmp_path / "photos"), inputs)


def test_a_damaged_record_is_named(tmp_path):
    (tmp_path / "preprocessing.json").write_text("{not json")
    with pytest.raises(InputError, match=r"preprocessing.json' cannot be read .* delete it"):
        images.recorded(tmp_path)
