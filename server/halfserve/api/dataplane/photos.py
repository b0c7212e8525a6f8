"""Photos as the model's input: a request's encoded images decoded and transformed by the manifest's ``image``
section (:mod:`halfserve.images`) off the event loop, its errors as the domain's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from halfserve import images
from halfserve.api.dataplane.bounds import check_size
from halfserve.errors import InvalidInputError, OverLimitError, QueueFullError
from halfserve.serving import ModelHandle
from halfserve.settings import Settings


def image_count(settings: Settings, served: ModelHandle, count: int, field: str) -> None:
    """Refuse a request of more images than ``max_request_images`` (413), or more rows than a request may carry, and
    one of none (400), before any is decoded."""
    if count == 0:
        raise InvalidInputError(f"{field}: no image; send one ({images.ACCEPTED})")
    if count > settings.max_request_images:
        raise OverLimitError(
            f"{field}: {count} images, more than the {settings.max_request_images} one request may carry "
            "(max_request_images)"
        )
    check_size(settings, served, count, field)


def no_images(served: ModelHandle, field: str = "") -> InvalidInputError:
    """The refusal of photos sent to a model without an image section (``field``: the request field that holds them,
    where the route names one); a model with a handler section is pointed to the route that runs its handler."""
    where = f"{field}: " if field else ""
    if served.manifest.handler is not None:  # a TorchServe archive's: its handler reads the photos, not this route
        return InvalidInputError(
            f"{where}model {served.name!r} reads photos through its handler: send them to /predictions/{served.name} "
            "(the raw body, or form fields named data or body)"
        )
    return InvalidInputError(
        f"{where}model {served.name!r} takes no images: its manifest has no image section (halfserve import --image)"
    )


async def decode_photos(
    photos: Sequence[bytes], fields: Sequence[str], served: ModelHandle, settings: Settings
) -> dict[str, np.ndarray]:
    """The photos' pixels as the input their manifest's ``image`` section feeds, one row each: a 400 naming the field
    of a photo in a format the server does not take or that does not decode, a 413 for one of more than
    ``max_image_pixels``, a 503 with ``Retry-After`` when more requests wait to be decoded than the queue holds."""
    spec = served.manifest.image
    if spec is None:
        raise no_images(served)
    try:
        pixels = await images.decode_off_loop(photos, spec, settings.max_image_pixels, fields)
    except images.ImageTooLargeError as e:
        raise OverLimitError(str(e)) from None
    except images.ImageBusyError as e:  # as a full batch queue
        raise QueueFullError(str(e)) from None
    except images.ImageError as e:
        raise InvalidInputError(str(e)) from None
    target = next(t for t in served.manifest.inputs if t.name == spec.feeds)
    return {target.name: pixels.astype(target.datatype.numpy, copy=False)}
