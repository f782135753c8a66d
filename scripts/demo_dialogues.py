"""Write the demo model's training text: short chat dialogues on a few dozen simple topics.

    python scripts/demo_dialogues.py            # (re)writes deltaserve/demo_model/training_text.txt

Every dialogue is generated from the topics and phrasings below with a fixed seed and rendered with the demo
chat template (deltaserve/demo.py), so the text is exactly what the served model sees: a system prompt or not,
one or two user turns, and a final assistant turn that either thinks (`<think>\\n...\\n</think>\\n\\n` then the
answer) or has thinking switched off (the template's empty `<think>\\n\\n</think>\\n\\n`). Dialogues are separated
by `<|endoftext|>\\n`. scripts/train_demo.py trains the demo tokenizer and model on this text.
"""

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deltaserve.demo import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

TEXT_PATH = ROOT / "deltaserve" / "demo_model" / "training_text.txt"
SEPARATOR = "<|endoftext|>\n"
SEED = 0
NUM_DIALOGUES = 900

# topic -> facts, each a plain sentence. The topic is named in questions as written here.
TOPICS = {
    "the sun": ["The sun is a star.", "It gives us light and warmth.", "The sun rises in the east.",
                "It sets in the west in the evening.", "Plants need sunlight to grow."],
    "the moon": ["The moon goes around the earth.", "It shines with light from the sun.",
                 "The moon looks different every night.", "People have walked on the moon.",
                 "The moon pulls on the sea and makes the tides."],
    "the sea": ["The sea is full of salt water.", "It covers most of the earth.", "Fish and whales live in the sea.",
                "The sea has waves and tides.", "Ships sail across the sea."],
    "rain": ["Rain is water that falls from clouds.", "It helps plants and trees grow.",
             "After rain you may see a rainbow.", "Rain fills rivers and lakes.",
             "People carry an umbrella in the rain."],
    "snow": ["Snow is frozen water that falls from clouds.", "It is white and cold.", "Snow falls in winter.",
             "Children like to build a snowman.", "Snow melts when the sun comes out."],
    "trees": ["Trees are tall plants with wood.", "They have roots, a trunk and leaves.",
              "Trees give us shade and fruit.",
              "Many trees lose their leaves in autumn.", "Birds build nests in trees."],
    "cats": ["Cats are small animals with soft fur.", "They like to sleep in warm places.", "A cat says meow.",
             "Cats can see well at night.", "Many people keep a cat at home."],
    "dogs": ["Dogs are loyal friends of people.", "A dog says woof.", "Dogs like to run and play.",
             "They have a very good nose.", "People walk their dog every day."],
    "birds": ["Birds have feathers and wings.", "Most birds can fly.", "Birds lay eggs in a nest.",
              "Many birds sing in the morning.", "Some birds fly south in winter."],
    "fish": ["Fish live in water.", "They breathe with gills.", "Fish swim with their fins and tail.",
             "Some fish live in rivers and some in the sea.", "Many fish swim together in a school."],
    "bees": ["Bees are small insects that fly.", "They visit flowers to collect nectar.", "Bees make honey.",
             "A bee lives in a hive with many other bees.", "Bees help flowers and fruit to grow."],
    "horses": ["Horses are large and strong animals.", "They eat grass and hay.", "People ride horses.",
               "A young horse is called a foal.", "Horses can run very fast."],
    "bread": ["Bread is made from flour, water and yeast.", "It is baked in a hot oven.",
              "A baker makes fresh bread in the morning.", "People eat bread with butter or cheese.",
              "Warm bread smells very good."],
    "tea": ["Tea is a warm drink.", "It is made from the leaves of a plant.", "You pour hot water on the leaves.",
            "Some people drink tea with milk.", "Green tea and black tea come from the same plant."],
    "coffee": ["Coffee is a drink made from roasted beans.", "It is dark and a little bitter.",
               "Many people drink coffee in the morning.", "Coffee helps people feel awake.",
               "Some people add milk or sugar to their coffee."],
    "apples": ["Apples are round fruit.", "They grow on apple trees.", "An apple can be red, green or yellow.",
               "Apples are sweet and crunchy.", "People make apple pie and apple juice."],
    "water": ["Water is a clear liquid.", "All living things need water.", "Water freezes into ice when it is cold.",
              "It boils when it is very hot.", "Rivers, lakes and the sea are full of water."],
    "fire": ["Fire is hot and bright.", "It needs air and something to burn.", "People cook food over a fire.",
             "A fire gives light and warmth.", "Fire can be dangerous, so be careful."],
    "the wind": ["Wind is moving air.", "You cannot see the wind, but you can feel it.", "The wind moves the clouds.",
                 "A strong wind can bend trees.", "Wind turns windmills and fills the sails of boats."],
    "mountains": ["Mountains are very high land.", "It is cold at the top of a mountain.",
                  "Some mountains have snow all year.", "People climb mountains for the view.",
                  "A path winds up the side of the mountain."],
    "rivers": ["A river is water that flows over the land.", "Rivers start in the hills and mountains.",
               "Every river flows to a lake or the sea.", "People build bridges over rivers.",
               "Fish swim in the river."],
    "the sky": ["The sky is above us.", "On a clear day the sky is blue.",
                "At night the sky is dark and full of stars.",
                "Clouds float across the sky.", "At sunset the sky turns red and orange."],
    "stars": ["Stars are suns that are very far away.", "We see stars at night.", "Stars seem to twinkle.",
              "People have named groups of stars.", "Sailors once found their way by the stars."],
    "the seasons": ["There are four seasons.", "They are spring, summer, autumn and winter.",
                    "Spring brings flowers.", "Summer is warm and long.", "In winter the days are short and cold."],
    "the week": ["A week has seven days.",
                 "The days are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.",
                 "Many people work from Monday to Friday.", "Saturday and Sunday are the weekend.",
                 "After Sunday a new week begins."],
    "colours": ["There are many colours.", "Red, yellow and blue are colours.", "Grass is green and snow is white.",
                "A rainbow has seven colours.", "Mixing blue and yellow makes green."],
    "music": ["Music is made of sounds and rhythm.", "People sing songs and play instruments.",
              "A piano has black and white keys.", "Music can make people happy or calm.",
              "Many people like to dance to music."],
    "books": ["A book has pages with words.", "People read books to learn and to enjoy stories.",
              "You can borrow books from a library.", "Some books have pictures.",
              "A good book can take you to far places."],
    "clocks": ["A clock tells the time.", "It has hands or numbers.", "A day has twenty four hours.",
               "An hour has sixty minutes.", "People wake up with an alarm clock."],
    "bicycles": ["A bicycle has two wheels.", "You push the pedals to make it go.",
                 "Riding a bicycle is good exercise.", "A bicycle needs no fuel.",
                 "It is wise to wear a helmet on a bicycle."],
    "trains": ["A train runs on rails.", "It pulls many cars behind it.", "Trains carry people and goods.",
               "People wait for the train at a station.", "Some trains are very fast."],
    "ships": ["A ship is a large boat.", "Ships carry people and goods across the sea.",
              "A ship has a captain and a crew.", "Old ships had sails.", "A ship stops at a harbour."],
    "gardens": ["A garden is a place where plants grow.", "People grow flowers and vegetables in a garden.",
                "Plants in a garden need water and sun.", "Bees and birds visit the garden.",
                "Working in a garden is calm and pleasant."],
    "sleep": ["Sleep helps the body rest.", "Most people sleep at night.", "Children need more sleep than adults.",
              "People dream when they sleep.", "A good night of sleep makes you feel fresh."],
    "friends": ["A friend is someone you like and trust.", "Friends help each other.",
                "Friends talk, laugh and play together.", "A good friend listens to you.",
                "You can make new friends at school or at work."],
    "cooking": ["Cooking makes food warm and tasty.", "People cook on a stove or in an oven.",
                "Soup is made by cooking vegetables in water.", "A recipe tells you how to cook a dish.",
                "It is good to wash your hands before you cook."],
}
# Questions about things the model was not taught: it says so instead of inventing an answer.
UNKNOWN = ["quantum physics", "the stock market", "the capital of Peru", "a black hole", "the history of Rome",
           "computer chips", "the price of gold", "chess openings", "the rules of cricket", "tax law",
           "the speed of light", "volcanoes", "the human brain", "the French language", "electric cars"]

SYSTEM_PROMPTS = [None, None, None, "You are a helpful assistant.", "You are a friendly assistant. Answer briefly.",
                  "You are a tiny demo model. Be kind and simple.", "Answer in plain words."]
QUESTIONS = ["What is {t}?", "Tell me about {t}.", "What do you know about {t}?",
             "Can you tell me something about {t}?",
             "Describe {t} in a few words.", "I would like to learn about {t}.", "Say something about {t}, please.",
             "Explain {t} to me.", "What can you tell me about {t}?", "Please tell me about {t}."]
THOUGHTS = ["The user asks about {t}. I know that {f} I will answer in a few short sentences.",
            "This is a question about {t}. I remember that {f} Let me keep the answer simple.",
            "The user wants to hear about {t}. One thing I know is that {f} I will say it plainly.",
            "A question about {t}. {F} That is a good place to start the answer.",
            "I should explain {t}. First, {f} Then I can add one more fact."]
OPENERS = ["", "", "", "Sure. ", "Of course. ", "Here is what I know. ", "Good question. "]

GREETINGS = ["Hello!", "Hello", "Hi", "Hi!", "Hi there!", "Hey", "Good morning!", "Good evening.",
             "Hello, how are you?"]
GREETING_THOUGHTS = ["The user says hello. I will greet them and say what I can talk about.",
                     "A greeting. I should answer kindly and offer help."]
GREETING_ANSWERS = ["Hello! I am a tiny demo model. I can talk about simple things like the sun, cats or bread. "
                    "What would you like to know?",
                    "Hi! I am doing well, thank you. Ask me about the sea, trees, music or another simple topic.",
                    "Hello there! I know a little about the moon, dogs, tea and a few other things. How can I help?"]
ABOUT_QUESTIONS = ["Who are you?", "What are you?", "What can you do?", "What do you know?", "Are you a real model?"]
ABOUT_THOUGHT = "The user asks about me. I should say plainly what I am and what I know."
ABOUT_ANSWER = ("I am a tiny demo model that comes with deltaserve. I was trained on a small set of short dialogues, "
                "so I know only a few simple topics, like the sun, the sea, cats, bread and music. "
                "For real work, serve a real checkpoint.")
THANKS = ["Thank you!", "Thanks.", "Thanks a lot!", "Thank you, that helps."]
THANKS_ANSWERS = ["You are welcome!", "You are welcome. Ask me again any time.", "Happy to help!"]
GOODBYES = ["Goodbye!", "Bye.", "See you later!", "Good night."]
GOODBYE_ANSWERS = ["Goodbye! Have a nice day.", "Bye! Take care.", "Good night and sleep well."]


def lower_first(sentence: str) -> str:
    return sentence[0].lower() + sentence[1:]


def topic_turn(rng: random.Random, topic: str) -> tuple[str, str, str]:
    """(question, thought, answer) about one topic."""
    facts = TOPICS[topic]
    question = rng.choice(QUESTIONS).format(t=topic)
    picked = rng.sample(facts, rng.choice([2, 3, 3]))
    thought = rng.choice(THOUGHTS).format(t=topic, f=lower_first(picked[0]), F=picked[0])
    answer = rng.choice(OPENERS) + " ".join(picked)
    return question, thought, answer


def small_talk_turn(rng: random.Random) -> tuple[str, str, str]:
    """(question, thought, answer) for a greeting, a question about the model, thanks, a goodbye, or a topic
    the model does not know."""
    kind = rng.choice(["greeting", "greeting", "greeting", "about", "about", "thanks", "goodbye", "unknown",
                       "unknown"])
    if kind == "greeting":
        return rng.choice(GREETINGS), rng.choice(GREETING_THOUGHTS), rng.choice(GREETING_ANSWERS)
    if kind == "about":
        return rng.choice(ABOUT_QUESTIONS), ABOUT_THOUGHT, ABOUT_ANSWER
    if kind == "thanks":
        return rng.choice(THANKS), "The user thanks me. I will reply politely.", rng.choice(THANKS_ANSWERS)
    if kind == "goodbye":
        return rng.choice(GOODBYES), "The user says goodbye. I will wish them well.", rng.choice(GOODBYE_ANSWERS)
    subject = rng.choice(UNKNOWN)
    question = rng.choice(QUESTIONS).format(t=subject)
    thought = "I was not taught about this. I should say so and not make up an answer."
    answer = ("I am sorry, I do not know about that. I am a tiny demo model and I know only a few simple topics, "
              "like the sun, the sea and bread.")
    return question, thought, answer


def dialogue(rng: random.Random) -> tuple[list[dict], bool]:
    """(messages ending with the assistant turn to learn, whether thinking is on for that turn)."""
    messages = []
    system = rng.choice(SYSTEM_PROMPTS)
    if system is not None:
        messages.append({"role": "system", "content": system})
    for _ in range(1 if rng.random() < 0.8 else 2):
        if rng.random() < 0.75:
            question, thought, answer = topic_turn(rng, rng.choice(sorted(TOPICS)))
        else:
            question, thought, answer = small_talk_turn(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer, "reasoning_content": thought})
    thinking = rng.random() < 0.7
    if not thinking:
        messages[-1]["reasoning_content"] = ""  # rendered as the template's empty think block
    return messages, thinking


def training_text(num_dialogues: int = NUM_DIALOGUES, seed: int = SEED) -> str:
    rng = random.Random(seed)
    tokenizer = build_tokenizer()  # only its chat template is used here
    assert tokenizer.chat_template == CHAT_TEMPLATE
    rendered = []
    for _ in range(num_dialogues):
        messages, thinking = dialogue(rng)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True,
                                               enable_thinking=thinking)
        assert text.startswith(prompt), (prompt, text)  # the learned turn continues the served prompt exactly
        rendered.append(text)
    return SEPARATOR.join(rendered) + SEPARATOR


def main() -> None:
    text = training_text()
    TEXT_PATH.parent.mkdir(parents=True, exist_ok=True)
    TEXT_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {TEXT_PATH} ({len(text.encode()):,} bytes, {text.count(SEPARATOR)} dialogues)")


if __name__ == "__main__":
    main()
