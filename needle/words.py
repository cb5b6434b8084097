"""Word lists for needle keys and word values (written for this project)."""

ADJECTIVES = """
amber ancient autumn bitter blue bold brave bright broken calm careful cheerful clever
cold copper crimson curious dark distant dry dusty eager early empty faint fierce gentle
golden grand green grey hidden hollow honest humble icy idle jolly keen kind late lazy
little lively lonely loud lucky mellow merry misty modest narrow noble odd pale patient
plain polite proud quick quiet rapid rare rough round royal rusty sandy scarlet secret
shallow sharp shiny shy silent silver simple sleepy slow small smooth soft solemn sour
spare steady steep still stormy strange strong sudden sunny swift tall tender thin tidy
tiny twisted velvet vivid warm wary weary wide wild windy wise wooden young
""".split()

NOUNS = """
acorn anchor apple arrow badger banner barrel basket beacon beetle bell bicycle blanket
bottle bramble bridge bucket button cabin candle canyon carpet castle cedar chalk cherry
chimney cloud clover comet compass cottage crater crow cushion daisy dolphin dragon drum
eagle engine falcon feather fern fiddle flag forest fountain fox garden garnet glacier
goblet harbor harp hazel helmet heron hill island ivy jacket kettle kite ladder lantern
lemon lighthouse lily locket maple marble meadow mirror moon mountain needle nest oak
orchard otter owl paddle palace parrot pebble pepper piano pigeon pine planet pocket pond
quarry quill rabbit raven ribbon river robin rocket saddle sail shell shovel sparrow
spider spoon squirrel star stone storm summit swan teapot thistle thunder tiger tower
trumpet tulip turtle valley violin wagon walnut whistle willow window wolf
""".split()
